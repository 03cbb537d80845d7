"""The quantizers and loaders on the 2025-26 families (Qwen3, Qwen3-MoE, Gemma 2 and 3, gpt-oss, OLMo 2).

What is quantized: every attention and MLP projection, each Qwen3-MoE expert's; what stays float: the
norms (q/k norms included), the MoE routers, gpt-oss's sinks and its stacked experts (not linear
layers: a warning says so). A quantized checkpoint loads to the same logits as the model it was saved
from, serves through the engine (greedy tokens equal the no-cache reference decoder on the same
weights), and its logits stay near the float model's (random tiny models: loose bounds). AWQ's and
SmoothQuant's rescaling keeps the float function exactly on every norm layout (Gemma's offset norms,
OLMo 2's post-norms, which leave q/k/v and gate/up without a norm to fold into).
"""

from __future__ import annotations

import logging

import pytest
import torch
from baton.common.checkpoint import load_checkpoint
from baton.common.model import MLP, RMSNorm, greedy_generate
from baton.common.moe import GptOssMoE, MoE
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.quantization import QuantConfig, load_model, quantize_model, save_quantized
from baton.serve.quantization.calibration import CalibrationError
from baton.serve.quantization.linear import QuantLinear, set_compute_dtype
from baton.serve.quantization.prune import PruneConfig, prune_model
from baton.serve.quantization.scaling import fold_scales, scale_groups
from baton.serve.sampling_params import SamplingParams
from torch import nn

from .conftest import run_staggered
from .test_families import make_family_checkpoint

FAMILIES = ["qwen3", "qwen3_moe", "gemma3_text", "gemma2", "gpt_oss", "olmo2"]
DENSE = ["qwen3", "gemma3_text", "gemma2", "olmo2"]
CALIB = torch.randint(0, 301, (8, 32), generator=torch.Generator().manual_seed(1))
IDS = torch.randint(0, 301, (2, 40), generator=torch.Generator().manual_seed(2))
# Relative logit error ||q - f|| / ||f|| measured on these random models: int4 0.18-0.33, int8 <= 0.08,
# fp8 <= 0.16, W8A8 <= 0.03. The bounds leave room; a broken module (a router or a norm quantized, a
# layer skipped or garbled) is far outside them.
MAX_ERROR = {"int4": 0.5, "int8": 0.15, "fp8": 0.3, "w8a8": 0.1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = make_family_checkpoint(tmp_path_factory.mktemp(family), family)[1]
        return made[family]

    return get


def _float(ckpt):
    return load_checkpoint(ckpt, dtype=torch.float32).model


def _check_quantized_modules(model) -> None:
    """Projections quantized; routers, norms, sinks and gpt-oss's stacked experts float."""
    for layer in model.model.layers:
        a = layer.self_attn
        assert all(isinstance(getattr(a, n), QuantLinear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        assert all(m.weight.dtype == torch.float32 for m in layer.modules() if isinstance(m, RMSNorm))
        if a.sinks is not None:
            assert isinstance(a.sinks, nn.Parameter) and a.sinks.dtype == torch.float32
        ffn = layer.ffn
        if isinstance(ffn, MLP):
            assert all(isinstance(getattr(ffn, n), QuantLinear) for n in ("gate_proj", "up_proj", "down_proj"))
        elif isinstance(ffn, GptOssMoE):
            assert type(ffn.router) is nn.Linear
            assert all(p.dtype == torch.float32 for p in ffn.experts.parameters())
        else:
            assert isinstance(ffn, MoE) and type(ffn.gate) is nn.Linear
            assert all(isinstance(m, QuantLinear) for e in ffn.experts for m in e.children())


def _error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_gptq_int4_quantizes_the_projections_loads_and_serves(checkpoints, tmp_path, family, caplog):
    model = _float(checkpoints(family))
    with torch.no_grad():
        ref = model(IDS)
    qcfg = QuantConfig("gptq", 4, 32)
    with caplog.at_level(logging.WARNING, logger="baton.serve.quantization.quantize"):
        quantize_model(model, qcfg, CALIB)
    assert ("stacked experts" in caplog.text) == (family == "gpt_oss"), caplog.text
    _check_quantized_modules(model)
    out = save_quantized(tmp_path / "q", model, qcfg)
    loaded = load_model(out).model
    _check_quantized_modules(loaded)
    with torch.no_grad():
        got = loaded(IDS)
        assert torch.equal(got, model(IDS)), "saved and loaded: the same weights, the same logits"
    assert _error(got, ref) < MAX_ERROR["int4"]
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.5
    engine = LLMEngine.from_checkpoint(out, EngineConfig(num_kv_blocks=64, block_size=8))
    prompts = [IDS[0, :9].tolist(), IDS[1, :23].tolist()]
    got = run_staggered(engine, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), every=1)
    for p, tokens in zip(prompts, got):  # the paged engine = the no-cache decoder, on the quantized weights
        assert tokens == greedy_generate(engine.model, torch.tensor([p]), 10)[0].tolist(), family


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "olmo2"])
@pytest.mark.parametrize("qcfg", [QuantConfig("rtn", 8), QuantConfig("fp8", 8)], ids=["int8", "fp8"])
def test_round_to_nearest_formats_load_and_stay_close(checkpoints, tmp_path, family, qcfg):
    model = _float(checkpoints(family))
    with torch.no_grad():
        ref = model(IDS)
    out = save_quantized(tmp_path / "q", quantize_model(model, qcfg), qcfg)
    loaded = load_model(out).model
    _check_quantized_modules(loaded)
    set_compute_dtype(loaded, None)  # exact activations (int8 on CPU serves with bf16 ones)
    with torch.no_grad():
        assert _error(loaded(IDS), ref) < MAX_ERROR[qcfg.format]


@pytest.mark.parametrize("family", DENSE)
def test_awq_and_smoothquant_rescaling_keeps_the_float_model(checkpoints, family):
    """Random scales folded into every group leave the logits as they were; the groups are the
    norm layout's (no norm before q/k/v or gate/up under OLMo 2's post-norms)."""
    model = _float(checkpoints(family))
    with torch.no_grad():
        ref = model(IDS)
    g = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        groups = scale_groups(layer)
        prevs = [type(x.prev).__name__ for x in groups]
        norms = {"olmo2": 0}.get(family, 2)
        assert prevs.count("RMSNorm") == norms, prevs
        if layer.norm_layout == "sandwich":
            assert any(x.prev is layer.pre_feedforward_layernorm for x in groups)
        for group in groups:
            fold_scales(group, torch.rand(group.prev.weight.shape[0], generator=g) + 0.5)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("family", ["gemma3_text", "olmo2"])
@pytest.mark.parametrize(
    "qcfg", [QuantConfig("awq", 4, 32, awq_grid=5), QuantConfig("smoothquant", 8)], ids=["awq", "smoothquant"]
)
def test_awq_and_smoothquant_load_and_stay_close(checkpoints, tmp_path, family, qcfg):
    model = _float(checkpoints(family))
    with torch.no_grad():
        ref = model(IDS)
    out = save_quantized(tmp_path / "q", quantize_model(model, qcfg, CALIB), qcfg)
    loaded = load_model(out).model
    _check_quantized_modules(loaded)
    with torch.no_grad():
        assert _error(loaded(IDS), ref) < MAX_ERROR[qcfg.format]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_awq_refuses_moe_families_clearly(checkpoints, family):
    model = _float(checkpoints(family))
    with pytest.raises(CalibrationError, match="dense .non-MoE. models; use gptq or rtn for MoE models"):
        quantize_model(model, QuantConfig("awq", 4, 32), CALIB)


def test_pruning_olmo2_cuts_its_full_width_qk_norms_with_the_heads(checkpoints):
    model = _float(checkpoints("olmo2"))
    pruned = prune_model(model, PruneConfig(heads=0.5), CALIB)
    attn = pruned.model.layers[0].self_attn
    assert pruned.config.num_attention_heads == 2 and attn.q_norm.weight.shape == (2 * attn.head_dim,)
    assert attn.k_norm.weight.shape == (attn.head_dim,)
    with torch.no_grad():
        assert torch.isfinite(pruned(IDS)).all()
