"""The recipe's `attention:` core. Baton's Triton FlashAttention (forward and backward kernels, run
here by the Triton interpreter on CPU tensors, in fp32 where the interpreter is exact) and the
unfused eager core against torch SDPA: outputs and q/k/v gradients, then a whole model's loss
and parameter gradients. Refusals; and what selective recomputation does with a fused core."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from torch.testing import assert_close

from baton.common.config import ConfigError, ModelConfig
from baton.common.model import DenseCausalAttention, build_model
from baton.train import attention
from baton.train.attention import TritonFlashAttention, attention_core
from baton.train.backends import lm_loss
from baton.train.config import RecomputeConfig
from baton.train.recipe import config_from_dict
from baton.train.recompute import EagerAttention, SelectiveRecompute, apply_recompute

from .conftest import TINY

pytestmark = pytest.mark.skipif(
    not attention.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)"
)

FP32 = dict(rtol=2e-5, atol=2e-5)


def qkv(b=2, s=40, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("core", [TritonFlashAttention, EagerAttention], ids=["triton", "eager"])
@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window7"])
def test_core_equals_sdpa_forward_and_backward(core, window):
    """GQA (4 query / 2 key-value heads), 40 tokens (not a multiple of the kernels' 32-token tiles)."""
    layer = types.SimpleNamespace(scaling=16**-0.5, sliding_window=window, layer_idx=0)
    ref_in, in_ = qkv(), qkv()
    dout = torch.randn(2, 40, 4, 16, generator=torch.Generator().manual_seed(1))
    want = DenseCausalAttention()(*ref_in, layer)
    want.backward(dout)
    got = core()(*in_, layer)
    got.backward(dout)
    assert_close(got, want, **FP32)
    for name, a, b in zip("qkv", in_, ref_in):
        assert_close(a.grad, b.grad, **FP32, msg=f"d{name}")


def test_model_trained_through_triton_attention_has_sdpa_loss_and_gradients():
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=12,
        model_type="qwen2",
        qkv_bias=True,
        layer_types=["full_attention", "sliding_attention"],  # layer 1 slides a 12-token window
    )
    assert cfg.is_sliding(1) and not cfg.is_sliding(0)
    batch = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    results = []
    for name in ("sdpa", "triton"):
        model = build_model(cfg, seed=0)
        loss = lm_loss(model(batch[:, :-1], attn=attention_core(name)), batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, grads) = results
    assert_close(got, want, **FP32)
    for n in want_grads:
        assert_close(grads[n], want_grads[n], rtol=1e-4, atol=1e-5, msg=n)


def test_triton_attention_refusals(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("with a GPU, attention triton is allowed")
    assert config_from_dict(TINY, ["attention=triton"]).attention == "triton"  # interpreter, fp32: a faithful check
    with pytest.raises(ConfigError, match="rounds bf16"):
        config_from_dict(TINY, ["attention=triton", "precision=bf16"])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="need a CUDA GPU"):
        config_from_dict(TINY, ["attention=triton"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="ring attention"):
        config_from_dict(TINY, ["attention=eager", "backend=torch3d", "parallel.cp=2"])
    with pytest.raises(ConfigError, match="attention must be one of"):
        config_from_dict(TINY, ["attention=flash"])


def test_selective_recompute_keeps_the_eager_core_checkpointed_and_says_what_it_does_for_fused_ones(caplog):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    model = build_model(cfg, seed=0)
    assert isinstance(apply_recompute(model, RecomputeConfig("selective"), "eager"), SelectiveRecompute)
    with caplog.at_level(logging.WARNING, logger="baton.train.recompute"):
        core = apply_recompute(model, RecomputeConfig("selective"), "triton")
    assert isinstance(core, TritonFlashAttention)  # not checkpointed: a second flash forward would save only its output
    assert "recomputing every RMSNorm and SwiGLU activation instead" in caplog.text
    layer = model.model.layers[0]
    assert type(layer.mlp).__name__ == "_RecomputedMLP" and type(layer.input_layernorm).__name__ == "_RecomputedNorm"


def test_selective_with_a_fused_core_changes_no_number_in_a_moe_model():
    """The experts' SwiGLU is recomputed too (Mixtral-style layers); gradients stay bit-identical."""
    cfg = ModelConfig(
        model_type="mixtral",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    grads = []
    for mode in ("none", "selective"):
        model = build_model(cfg, seed=0)
        attn = apply_recompute(model, RecomputeConfig(mode), "sdpa")
        lm_loss(model(batch[:, :-1], attn=attn), batch).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert type(model.model.layers[0].block_sparse_moe.experts[0]).__name__ == "_RecomputedExpert"
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
