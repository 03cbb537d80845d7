"""Baton <-> megatron-core layout in pure torch: round trips from HF models built by transformers,
and each layout fact checked against the HF tensors by explicit indexing (not by the inverse).
Nothing here imports megatron; test_megatron_interop.py checks the layout against GPTModel."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

from baton.common.checkpoint import load_state_dict, read_config
from baton.common.config import ConfigError, ModelConfig
from baton.common.hf import import_hf
from baton.common.megatron_layout import (
    baton_to_megatron,
    from_dist_layout,
    layer_range,
    megatron_to_baton,
    padded_vocab_size,
    to_dist_layout,
)

BASE = {"vocab_size": 200, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 8}
MODELS = {
    "llama-gqa": (transformers.LlamaConfig, {"num_key_value_heads": 2}),  # 2 KV groups: fewer than tp=4
    "qwen2-bias": (transformers.Qwen2Config, {"num_key_value_heads": 4}),
    "llama-mqa-tied": (transformers.LlamaConfig, {"num_key_value_heads": 1, "tie_word_embeddings": True}),
}
LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (4, 2, 1), (2, 2, 2)]  # (tp, pp, vp)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    """(name, HF state dict, Baton config, Baton state dict): Baton's weights come from disk."""
    config_cls, extra = MODELS[request.param]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**BASE, **extra)).float()
    with torch.no_grad():  # HF inits biases to zero and norms to one: make every tensor distinct
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_()
    tmp = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(tmp / "hf")
    baton_dir = import_hf(tmp / "hf", tmp / "baton")
    return request.param, hf.state_dict(), read_config(baton_dir), load_state_dict(baton_dir)


def shard_all(sd, cfg, tp, pp, vp, **kw):
    return {
        (t, p, v): baton_to_megatron(sd, cfg, tp, t, pp, p, vp, vp_rank=v, **kw)
        for t in range(tp)
        for p in range(pp)
        for v in range(vp)
    }


@pytest.mark.parametrize("tp,pp,vp", LAYOUTS)
def test_hf_baton_megatron_baton_is_bit_exact(model, tp, pp, vp):
    name, hf_sd, cfg, sd = model
    back = megatron_to_baton(shard_all(sd, cfg, tp, pp, vp), cfg)
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in back
    expected = {k: v for k, v in hf_sd.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert back.keys() == expected.keys(), name
    for key, t in expected.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), f"{name} tp={tp} pp={pp} vp={vp}: {key}"


def test_fc1_shards_gate_and_up_separately(model):
    """Rank r's fc1 is [gate rows of r; up rows of r]. The classic bug - one block of the fused
    [gate; up] - has the same shape, so the check is on the rows themselves."""
    _, hf_sd, cfg, sd = model
    gate, up = hf_sd["model.layers.1.mlp.gate_proj.weight"], hf_sd["model.layers.1.mlp.up_proj.weight"]
    tp, k = 4, cfg.intermediate_size // 4
    for r in range(tp):
        fc1 = baton_to_megatron(sd, cfg, tp, r)["decoder.layers.1.mlp.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([gate[r * k : (r + 1) * k], up[r * k : (r + 1) * k]]))
    classic = torch.cat([gate, up]).chunk(tp)[0]
    assert classic.shape == fc1.shape and not torch.equal(classic, torch.cat([gate[:k], up[:k]]))


def test_qkv_is_interleaved_per_query_group(model):
    """Group g's rows are [q heads of g, k_g, v_g] (Qwen2's biases too), and TP rank r holds rows
    r/tp of that; linear_proj and fc2 are split on their input columns."""
    _, hf_sd, cfg, sd = model
    g, d = cfg.num_key_value_heads, cfg.head_dim
    n = cfg.num_attention_heads // g
    a = "model.layers.2.self_attn."
    for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
        q, k, v = (hf_sd[f"{a}{p}_proj.{kind}"] for p in "qkv")
        groups = [
            torch.cat([q[j * n * d : (j + 1) * n * d], k[j * d : (j + 1) * d], v[j * d : (j + 1) * d]])
            for j in range(g)
        ]
        full = torch.cat(groups)
        assert torch.equal(baton_to_megatron(sd, cfg)[f"decoder.layers.2.self_attention.linear_qkv.{kind}"], full)
        rows = full.shape[0] // 4
        for r in range(4):
            shard = baton_to_megatron(sd, cfg, 4, r)[f"decoder.layers.2.self_attention.linear_qkv.{kind}"]
            assert torch.equal(shard, full[r * rows : (r + 1) * rows])
    o, down = hf_sd[a + "o_proj.weight"], hf_sd["model.layers.2.mlp.down_proj.weight"]
    shard = baton_to_megatron(sd, cfg, 2, 1)
    assert torch.equal(shard["decoder.layers.2.self_attention.linear_proj.weight"], o[:, o.shape[1] // 2 :])
    assert torch.equal(shard["decoder.layers.2.mlp.linear_fc2.weight"], down[:, down.shape[1] // 2 :])


def test_vocab_padding_stages_and_tied_copy(model):
    _, hf_sd, cfg, sd = model
    tp, vocab = 2, padded_vocab_size(cfg.vocab_size, 2, 128)
    assert vocab == 256
    embed = hf_sd["model.embed_tokens.weight"]
    first = baton_to_megatron(sd, cfg, tp, 1, pp_size=2, pp_rank=0)
    assert torch.equal(first["embedding.word_embeddings.weight"][: cfg.vocab_size - 128], embed[128:])
    assert not first["embedding.word_embeddings.weight"][cfg.vocab_size - 128 :].any()  # zero padding rows
    assert "output_layer.weight" not in first and "decoder.final_layernorm.weight" not in first
    last = baton_to_megatron(sd, cfg, tp, 0, pp_size=2, pp_rank=1)
    assert "embedding.word_embeddings.weight" not in last
    head = embed if cfg.tie_word_embeddings else hf_sd["lm_head.weight"]
    assert torch.equal(last["output_layer.weight"], head[:128])  # the tied copy on the last stage
    # PP=1 with tied embeddings: GPTModel has no output_layer weight at all
    assert ("output_layer.weight" in baton_to_megatron(sd, cfg)) != cfg.tie_word_embeddings
    # stage 1 of 2 numbers its layers from 0: its layer 0 is global layer 2
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"], hf_sd["model.layers.2.input_layernorm.weight"])
    te = baton_to_megatron(sd, cfg, spec="te")
    assert torch.equal(
        te["decoder.layers.3.mlp.linear_fc1.layer_norm_weight"], hf_sd["model.layers.3.post_attention_layernorm.weight"]
    )


def test_interleaved_layer_assignment():
    """Megatron's virtual stages: chunk (pp_rank, vp_rank) holds layers v*L/vp + p*L/(pp*vp) onward."""
    assert [list(layer_range(8, 2, p, 2, v)) for v in range(2) for p in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(layer_range(8, 2, 1)) == [4, 5, 6, 7]
    assert list(layer_range(12, 2, 1, 3, 2)) == [10, 11]


def test_dist_layout_round_trip(model):
    _, _hf_sd, cfg, sd = model
    tensors = to_dist_layout(sd, cfg, tp_size=4)
    assert tensors["embedding.word_embeddings.weight"].shape[0] == 512  # padded for a tp=4 run
    assert tensors["decoder.layers.mlp.linear_fc1.weight"].shape[0] == cfg.num_hidden_layers
    assert ("output_layer.weight" in tensors) != cfg.tie_word_embeddings  # tied: stored once
    back = from_dist_layout(tensors, cfg)
    assert all(torch.equal(back[k], t) for k, t in sd.items()) and back.keys() == sd.keys()


@pytest.mark.parametrize(
    "model_kw,layout,match",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 3}, (2, 1, 1), "must divide one another"),
        ({"num_attention_heads": 6, "num_key_value_heads": 6}, (4, 1, 1), "num_attention_heads"),
        ({}, (1, 3, 1), "pp\\*vp"),
        ({}, (1, 2, 4), "pp\\*vp"),
        ({"attention_bias": True}, (1, 1, 1), "attention_bias"),
        ({"num_local_experts": 2}, (1, 1, 1), "MoE"),
    ],
)
def test_refusals(model_kw, layout, match):
    cfg = ModelConfig(**{**BASE, "num_key_value_heads": 2, **model_kw})
    with pytest.raises(ConfigError, match=match):
        baton_to_megatron({}, cfg, layout[0], 0, layout[1], 0, layout[2])


def test_runs_without_megatron_core():
    """The layout is pure torch: with megatron unimportable, a TP=2 x PP=2 round trip still works."""
    code = (
        "import sys, torch; sys.modules['megatron'] = None\n"
        "from baton.common.config import ModelConfig\n"
        "from baton.common.model import build_model\n"
        "from baton.common.megatron_layout import baton_to_megatron, megatron_to_baton\n"
        f"cfg = ModelConfig(**{BASE!r}, num_key_value_heads=2)\n"
        "sd = build_model(cfg).checkpoint_state_dict()\n"
        "sh = {(t, p): baton_to_megatron(sd, cfg, 2, t, 2, p) for t in range(2) for p in range(2)}\n"
        "back = megatron_to_baton(sh, cfg)\n"
        "assert all(torch.equal(back[k], sd[k]) for k in sd) and back.keys() == sd.keys()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_tensors_the_config_does_not_describe_are_refused(model):
    """A Megatron model with more than the config says (here a q layernorm) must not lose it silently."""
    _, _, cfg, sd = model
    shard = baton_to_megatron(sd, cfg)
    shard["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(cfg.head_dim)
    with pytest.raises(ValueError, match="q_layernorm.weight', which the config does not describe"):
        megatron_to_baton(shard, cfg)
    del shard["decoder.layers.0.self_attention.q_layernorm.weight"], shard["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match="has no 'decoder.layers.1.mlp.linear_fc2.weight'"):
        megatron_to_baton(shard, cfg)
