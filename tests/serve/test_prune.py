"""Structured pruning: importance picks what provably does not matter, the smaller checkpoint's
config is updated, and it loads in LLM and in transformers with the same logits."""

import json

import pytest
import torch
import transformers

from baton.common.checkpoint import load_checkpoint
from baton.common.cli import main
from baton.serve.engine import EngineConfig
from baton.serve.llm import LLM
from baton.serve.quantization.prune import PruneConfig, importance, prune_model
from baton.serve.sampling_params import SamplingParams

from .conftest import TEXT


def _silence(model, group: int, channel: int):
    """Zero KV group `group`'s o_proj columns and MLP channel `channel` in every layer: the model's
    output no longer depends on them, so their first-order importance is exactly zero."""
    cfg = model.config
    width = cfg.num_attention_heads // cfg.num_key_value_heads * cfg.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:, group * width : (group + 1) * width] = 0
            layer.mlp.gate_proj.weight[channel] = 0
            layer.mlp.up_proj.weight[channel] = 0
            layer.mlp.down_proj.weight[:, channel] = 0
    return model


@pytest.fixture
def silenced(llama_dir):
    return _silence(load_checkpoint(llama_dir).model, group=1, channel=7)


def test_importance_is_zero_exactly_for_silenced_units(silenced):
    tokens = torch.randint(0, 320, (4, 24), generator=torch.Generator().manual_seed(0))
    heads, channels = importance(silenced, tokens)
    assert heads.shape == (2, 2) and channels.shape == (2, 96)
    assert (heads[:, 1] == 0).all() and (heads[:, 0] > 0).all()
    assert (channels[:, 7] == 0).all() and (channels.count_nonzero(dim=1) == 95).all()


def test_pruning_silenced_units_keeps_logits(silenced):
    """Removing a head group and channels that contribute nothing changes nothing; a new config results."""
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(1))
    want = silenced(ids)
    pruned = prune_model(silenced, PruneConfig(heads=0.5, channels=1 / 96), ids)
    c = pruned.config
    assert (c.num_key_value_heads, c.num_attention_heads, c.intermediate_size, c.head_dim) == (1, 2, 95, 16)
    torch.testing.assert_close(pruned(ids), want, rtol=1e-5, atol=1e-5)


def test_pruned_checkpoint_loads_in_llm_and_transformers(llama_dir, tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT * 8)
    assert (
        main(
            [
                "prune",
                str(llama_dir),
                str(tmp_path / "p"),
                "--heads",
                "0.5",
                "--channels",
                "0.25",
                "--data",
                str(data),
                "--seq-len",
                "32",
                "--val-fraction",
                "0.1",
                "--calib-samples",
                "8",
            ]
        )
        == 0
    )
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["head_dim"]) == (
        2,
        1,
        72,
        16,
    )
    ours = load_checkpoint(tmp_path / "p").model
    assert sum(p.numel() for p in ours.parameters()) < sum(
        p.numel() for p in load_checkpoint(llama_dir).model.parameters()
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "p").float().eval()
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
    out = (
        LLM(tmp_path / "p", EngineConfig(num_kv_blocks=32, block_size=8))
        .generate([ids[0].tolist()], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        .outputs[0]
    )
    with torch.no_grad():
        hf_ids = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )[0, 16:].tolist()
    assert out.token_ids == hf_ids


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--heads", "0.1"], "rounds to none"),
        (["--heads", "1.0"], "in [0, 1)"),
        ([], "nothing to prune"),
    ],
)
def test_cli_prune_bad_input(llama_dir, tmp_path, capsys, argv, message):
    assert main(["prune", str(llama_dir), str(tmp_path / "p"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_prune_rejects_moe(tmp_path):
    from baton.common.config import ModelConfig
    from baton.common.model import build_model

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    with pytest.raises(ValueError, match="dense"):
        prune_model(build_model(cfg), PruneConfig(channels=0.5), torch.randint(0, 64, (2, 8)))
