"""The converted weights in megatron-core's own GPTModel (local spec, CPU, one rank): a strict load
and Baton's logits, from baton_to_megatron's state dict and from a dist checkpoint written by
`baton convert --to-megatron`; the way back is bit-exact. The layer assignment is megatron's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baton.common.checkpoint import load_state_dict, save_model
from baton.common.cli import main
from baton.common.config import ModelConfig
from baton.common.errors import UserError
from baton.common.hf import config_to_hf
from baton.common.megatron_layout import baton_to_megatron, layer_range, padded_vocab_size
from baton.common.model import build_model

MODELS = {
    "qwen2-gqa-bias": {"num_key_value_heads": 2, "qkv_bias": True, "model_type": "qwen2"},
    "llama-mqa-tied": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "qwen2-mqa-bias-tied": {
        "num_key_value_heads": 1,
        "qkv_bias": True,
        "model_type": "qwen2",
        "tie_word_embeddings": True,
    },
}
SEQ = 12


def baton_model(name: str):
    cfg = ModelConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        **MODELS[name],
    )
    model = build_model(cfg, seed=1).eval()
    with torch.no_grad():  # norms and biases that are not ones and zeros, so a misplaced one shows
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return model


@pytest.fixture(scope="module")
def megatron():
    """One-rank gloo group and megatron-core's model-parallel state, torn down after the module."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from baton.common import megatron_compat

    megatron_compat.activate()
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def gpt_model(cfg: ModelConfig, vocab: int, tp: int = 1):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = TransformerConfig(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
    )
    model = GPTModel(
        tc,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
    )
    return model.eval()


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]  # True: masked
    with torch.no_grad():
        return model(tokens, torch.arange(SEQ).expand_as(tokens), attention_mask=mask)


def assert_same_logits(gpt, baton, vocab: int) -> None:
    tokens = torch.randint(0, 200, (2, SEQ), generator=torch.Generator().manual_seed(0))
    out = megatron_logits(gpt, tokens)
    with torch.no_grad():
        ref = baton(tokens)
    assert out.shape[-1] == vocab and ref.std() > 0.1
    err = (out[..., :200] - ref).abs().max().item()
    assert err < 1e-5, f"max |logit diff| {err:.2e}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_state_dict_loads_strictly_with_baton_logits(megatron, name):
    baton = baton_model(name)
    cfg, vocab = baton.config, padded_vocab_size(200)
    gpt = gpt_model(cfg, vocab)
    sd = baton_to_megatron(baton.checkpoint_state_dict(), cfg)
    extra = {k: v for k, v in gpt.state_dict().items() if k.endswith("_extra_state")}
    assert set(gpt.state_dict()) - set(extra) == set(sd)  # exactly the weights GPTModel has
    gpt.load_state_dict({**sd, **extra}, strict=True)
    assert_same_logits(gpt, baton, vocab)


def test_dist_checkpoint_round_trip_through_gpt_model(megatron, tmp_path):
    """convert --to-megatron (vocab padded for tp=2) -> GPTModel's own sharded load -> Baton's
    logits; convert --from-megatron -> the original tensors, bit for bit."""
    from megatron.core import dist_checkpointing

    baton = baton_model("qwen2-gqa-bias")
    save_model(tmp_path / "baton", baton)
    assert main(["convert", "--to-megatron", str(tmp_path / "baton"), str(tmp_path / "meg"), "--tp", "2"]) == 0
    vocab = padded_vocab_size(200, 2)
    gpt = gpt_model(baton.config, vocab)
    gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), str(tmp_path / "meg")), strict=True)
    assert_same_logits(gpt, baton, vocab)

    assert main(["convert", "--from-megatron", str(tmp_path / "meg"), str(tmp_path / "back")]) == 0
    original, back = load_state_dict(tmp_path / "baton"), load_state_dict(tmp_path / "back")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)


def test_megatron_written_checkpoint_to_hf_gives_megatrons_logits(megatron, tmp_path):
    """Weights that never were Baton's: a GPTModel's own dist checkpoint -> --from-megatron (the
    config given with --config) -> --to-hf -> transformers gives the GPTModel's logits."""
    import transformers
    from megatron.core import dist_checkpointing

    cfg = baton_model("qwen2-gqa-bias").config
    vocab = padded_vocab_size(200)
    gpt = gpt_model(cfg, vocab)
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2)
    (tmp_path / "meg").mkdir()
    dist_checkpointing.save(gpt.sharded_state_dict(), str(tmp_path / "meg"))
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    config = str(tmp_path / "config.json")
    assert main(["convert", "--from-megatron", str(tmp_path / "meg"), str(tmp_path / "b"), "--config", config]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "b"), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 200, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = megatron_logits(gpt, tokens)[..., :200]
        err = (hf(tokens).logits - ref).abs().max().item()
    assert ref.std() > 0.1 and err < 1e-4, err


@pytest.mark.slow
def test_tp_shards_in_megatron_give_baton_logits(tmp_path):
    """TP=2 with one KV head: each rank's shard in its GPTModel, the gathered logits Baton's."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "tp.json"
    script = Path(__file__).with_name("megatron_tp_run.py")
    subprocess.run([sys.executable, str(script), "2", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["vocab"] == padded_vocab_size(200, 2) and result["ref_std"] > 0.1
    assert result["max_abs_diff"] < 1e-5, result


@pytest.mark.parametrize("pp,vp", [(2, 1), (2, 2), (4, 2)])
def test_layer_range_is_megatrons(megatron, pp, vp):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tc = TransformerConfig(
        num_layers=16,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    for p in range(pp):
        for v in range(vp):
            offset = get_transformer_layer_offset(tc, vp_stage=v if vp > 1 else None, pp_rank=p)
            assert layer_range(16, pp, p, vp, v).start == offset, (p, v)


def test_missing_megatron_is_named(monkeypatch, tmp_path):
    from baton.common.megatron_checkpoint import load_megatron

    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(UserError, match=r'pip install -e "\.\[megatron\]"'):
        load_megatron(tmp_path, baton_model("llama-mqa-tied").config)


def test_convert_refuses_a_non_megatron_directory(tmp_path, capsys):
    assert main(["convert", "--from-megatron", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a megatron dist checkpoint" in capsys.readouterr().err
    assert main(["convert", "--to-hf", str(tmp_path), str(tmp_path / "out"), "--tp", "2"]) == 2
    assert "--tp does not apply to --to-hf" in capsys.readouterr().err
