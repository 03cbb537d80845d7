"""Baton's model against HF transformers on random-weight models of every supported family."""

from __future__ import annotations

import pytest
import torch
import transformers
from baton.common.checkpoint import load_checkpoint, load_state_dict, read_metadata
from baton.common.hf import export_hf, import_hf
from baton.common.model import greedy_generate
from safetensors import safe_open

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

FAMILIES = {
    "llama-gqa-llama3rope": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=2, rope_theta=50000.0, rope_scaling=LLAMA3_ROPE),
    ),
    "llama-mqa-bias": (transformers.LlamaConfig, dict(num_key_value_heads=1, attention_bias=True)),
    "llama-tied": (transformers.LlamaConfig, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-linear-rope-headdim": (
        transformers.LlamaConfig,
        dict(num_key_value_heads=2, head_dim=32, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "mistral-sliding": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=6, head_dim=16)),
    "qwen2-qkv-bias": (transformers.Qwen2Config, dict(num_key_value_heads=2)),
    "qwen2-sliding-layers": (
        transformers.Qwen2Config,
        dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "mixtral-moe": (
        transformers.MixtralConfig,
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    # The 2025-26 families: norms, biases and sinks are moved off their initial values (NEWER below).
    "qwen3-gqa": (transformers.Qwen3Config, dict(num_key_value_heads=2, head_dim=24)),
    "qwen3-mqa-tied-sliding": (
        transformers.Qwen3Config,
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        ),
    ),
    "qwen3-moe-dense-layer": (
        transformers.Qwen3MoeConfig,
        dict(
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=40,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
    "qwen3-moe-step2-unnormed": (
        transformers.Qwen3MoeConfig,
        dict(num_key_value_heads=4, num_experts=4, num_experts_per_tok=1, decoder_sparse_step=2),
    ),
    "gemma3-mixed-layers": (
        transformers.Gemma3TextConfig,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=4.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
    ),
    "gemma2-softcaps": (
        transformers.Gemma2Config,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=5,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
            attn_implementation="eager",
        ),
    ),
    "gpt-oss-yarn-sinks": (
        transformers.GptOssConfig,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            attn_implementation="eager",
        ),
    ),
    "olmo2-full-qk-norm": (transformers.Olmo2Config, dict(num_key_value_heads=2)),
}
NEWER = ("qwen3", "qwen3_moe", "gemma2", "gemma3_text", "gpt_oss", "olmo2")


@pytest.fixture(params=sorted(FAMILIES))
def family(request, tmp_path):
    config_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    hf_cfg = config_cls(**{**BASE, **extra})
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    if hf_cfg.model_type == "qwen2":  # HF inits biases to zero; make them matter
        with torch.no_grad():
            for name, p in hf_model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    if hf_cfg.model_type in NEWER:  # norms (Gemma's are zeros), biases and sinks each change the logits
        with torch.no_grad():
            for p in hf_model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.2)
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(hf_dir)
    baton_dir = import_hf(hf_dir, tmp_path / "baton")
    return request.param, hf_model, hf_dir, baton_dir, tmp_path


def test_logits_and_greedy_match_hf(family):
    name, hf_model, _, baton_dir, _ = family
    model = load_checkpoint(baton_dir).model.eval()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, BASE["vocab_size"], (3, 24), generator=gen)
    with torch.no_grad():
        ref = hf_model(tokens).logits
        out = model(tokens)
    err = (out - ref).abs().max().item()
    assert err < 1e-4, f"{name}: max |logit diff| {err:.2e}"
    assert ref.std() > 0.1, "logits are flat; the comparison would prove nothing"

    prompt = tokens[:2, :8]
    ref_ids = hf_model.generate(
        prompt,
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
        attention_mask=torch.ones_like(prompt),
        pad_token_id=0,
    )[:, 8:]
    ours = greedy_generate(model, prompt, 32)
    assert torch.equal(ours, ref_ids), f"{name}: greedy tokens differ"


def test_round_trip_hf_baton_hf_is_bit_identical(family):
    name, _, hf_dir, baton_dir, tmp_path = family
    out = export_hf(baton_dir, tmp_path / "hf_again")
    assert not (out / "baton.json").exists()
    original, again = load_state_dict(hf_dir), load_state_dict(out)
    assert original.keys() == again.keys(), name
    for key in original:
        assert original[key].dtype == again[key].dtype and torch.equal(original[key], again[key]), key
    assert read_metadata(baton_dir)["producer"].startswith("baton convert")


def test_export_loads_in_transformers_with_equal_logits(family):
    name, _, _, baton_dir, tmp_path = family
    loaded = load_checkpoint(baton_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export_hf(baton_dir, tmp_path / "exp")).eval()
    assert type(hf_model).__name__ == transformers.AutoConfig.from_pretrained(tmp_path / "exp").architectures[0]
    tokens = torch.randint(0, BASE["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (hf_model(tokens).logits - loaded.model(tokens)).abs().max().item()
    assert err < 1e-4, f"{name}: {err:.2e}"


def test_hf_fused_expert_names_are_accepted(tmp_path):
    """transformers 5 keeps Mixtral experts fused in memory; a state dict saved from memory loads."""
    from safetensors.torch import save_file

    config_cls, extra = FAMILIES["mixtral-moe"]
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**BASE, **extra})).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    save_file(
        {k: v.contiguous() for k, v in hf_model.state_dict().items()},
        tmp_path / "hf" / "model.safetensors",
        metadata={"format": "pt"},
    )
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert any("gate_up_proj" in k for k in f.keys())
    model = load_checkpoint(import_hf(tmp_path / "hf", tmp_path / "b")).model
    tokens = torch.randint(0, BASE["vocab_size"], (2, 12))
    with torch.no_grad():
        assert (model(tokens) - hf_model(tokens).logits).abs().max() < 1e-4
