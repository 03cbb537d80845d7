"""Config of the 2025-26 families: what each family fixes, and what Baton refuses at load, by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from baton.common.checkpoint import read_config
from baton.common.config import ConfigError, ModelConfig
from baton.common.hf_config import config_from_hf, config_to_hf
from baton.common.model import CausalLM

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
HF = {
    "qwen3": transformers.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16),
    "qwen3_moe": transformers.Qwen3MoeConfig(
        **SMALL, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
    ),
    "gemma2": transformers.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=16, sliding_window=8),
    "gemma3_text": transformers.Gemma3TextConfig(**SMALL, num_key_value_heads=2, head_dim=16, sliding_window=8),
    "gpt_oss": transformers.GptOssConfig(**SMALL, num_key_value_heads=2, head_dim=16, num_local_experts=4),
    "olmo2": transformers.Olmo2Config(**SMALL, num_key_value_heads=2),
    "deepseek_v3": transformers.DeepseekV3Config(  # (with one MTP module: transformers' default)
        **SMALL,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        kv_lora_rank=16,
        q_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        first_k_dense_replace=1,
    ),
}
DELTANET = dict(
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
HF |= {
    "qwen3_5_text": transformers.Qwen3_5TextConfig(**SMALL, **DELTANET),
    "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in SMALL.items() if k != "intermediate_size"},
        **DELTANET,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
    ),
    "qwen3_next": transformers.Qwen3NextConfig(
        **SMALL, **DELTANET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[0]
    ),
}


def hf_dict(name: str, **changes) -> dict:
    return {**json.loads(HF[name].to_json_string()), **changes}


@pytest.mark.parametrize("name", sorted(HF))
def test_every_family_round_trips_through_its_config_json(name, tmp_path):
    """config.json -> ModelConfig -> config.json -> ModelConfig is the same model, and transformers
    reads the written file as the family it came from."""
    cfg = config_from_hf(hf_dict(name))
    again = config_from_hf(config_to_hf(cfg))
    assert again == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    assert transformers.AutoConfig.from_pretrained(tmp_path).model_type == name
    assert read_config(tmp_path) == cfg


@pytest.mark.parametrize("name", sorted(HF))
def test_the_parameter_count_from_the_config_is_the_models(name):
    cfg = config_from_hf(hf_dict(name))
    with torch.device("meta"):
        model = CausalLM(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())


def test_a_recipe_names_the_family_and_gets_its_features():
    cfg = ModelConfig(**SMALL, model_type="gemma3_text")
    assert (cfg.qk_norm, cfg.norm_layout, cfg.norm_weight_offset, cfg.scale_embeddings) == ("head", "sandwich", 1, True)
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    assert ModelConfig(**SMALL, model_type="olmo2").qk_norm == "full"
    assert ModelConfig(**SMALL, model_type="qwen3_moe", num_local_experts=4).norm_topk_prob is False
    assert ModelConfig(**SMALL, model_type="gpt_oss", num_local_experts=4).swiglu_limit == 7.0
    q = ModelConfig(**{**SMALL, "num_hidden_layers": 8}, model_type="qwen3_5_text", full_attention_interval=2)
    assert q.layer_types == ["linear_attention", "full_attention"] * 4 and q.full_attention_interval is None
    assert (q.qk_norm, q.norm_weight_offset, q.attn_output_gate, q.rotary_dim) == ("head", 1.0, True, 4)
    assert (q.linear_num_value_heads, q.linear_value_head_dim, q.mixer) == (32, 128, "gated_deltanet")
    assert ModelConfig.from_dict(q.to_dict()) == q
    moe = ModelConfig(**{**SMALL, "num_hidden_layers": 4}, model_type="qwen3_next", num_local_experts=4)
    assert moe.shared_expert_intermediate_size == 512  # (transformers' defaults, and its 3:1 pattern)
    assert moe.layer_types == ["linear_attention"] * 3 + ["full_attention"]


def test_a_multimodal_qwen3_5_config_reads_its_text_part(caplog):
    outer = transformers.Qwen3_5MoeConfig(text_config=hf_dict("qwen3_5_moe_text"), tie_word_embeddings=True)
    with caplog.at_level("INFO", logger="baton.common.hf_config"):
        cfg = config_from_hf(json.loads(outer.to_json_string()))
    assert "multimodal qwen3_5_moe model: reading its text model (qwen3_5_moe_text" in caplog.text
    assert cfg == config_from_hf(hf_dict("qwen3_5_moe_text", tie_word_embeddings=True))


@pytest.mark.parametrize(
    "name, changes, message",
    [
        ("qwen3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "'longrope' is not supported"),
        ("gpt_oss", dict(layer_types=["chunked_attention", "full_attention"]), "'chunked_attention'"),
        ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma3_text", dict(model_type="gemma3"), "multimodal"),
        ("qwen3", dict(hidden_act="relu"), "hidden_act 'relu'"),
        (
            "gpt_oss",
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "smooth": 1}),
            "['smooth']",
        ),
        ("olmo2", dict(model_type="olmo3"), "unsupported model_type 'olmo3'"),
        ("deepseek_v3", dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
        ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax'"),
        ("deepseek_v3", dict(n_group=3), "divisible by n_group (3)"),
        ("qwen3_next", dict(linear_num_value_heads=3), "linear_num_value_heads (3) must be divisible"),
        ("qwen3_5_text", dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim must be a positive integer"),
        ("qwen3_5_text", dict(layer_types=["linear_attention", "sliding_attention"]), "asks for sliding_attention"),
        (
            "qwen3_5_text",
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
            "partial_rotary_factor 0.1 turns 1 of head_dim's 16",
        ),
        ("qwen3_5_moe_text", dict(num_experts=0), "model_type 'qwen3_5_moe_text' needs num_local_experts > 0"),
        ("qwen3_next", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size must be a positive"),
        ("qwen3_5_text", dict(model_type="qwen3_5"), "its text model must be in text_config"),
    ],
)
def test_a_field_baton_does_not_implement_is_refused_by_name(name, changes, message):
    with pytest.raises(ConfigError) as e:
        config_from_hf(hf_dict(name, **changes))
    assert message in str(e.value)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(model_type="llama", qk_norm="head"), "model_type 'llama' has qk_norm=None"),
        (dict(model_type="qwen3", norm_layout="post"), "model_type 'qwen3' has norm_layout='pre'"),
        (dict(model_type="qwen3", final_logit_softcapping=30.0), "final_logit_softcapping"),
        (dict(model_type="gemma3_text", attn_logit_softcapping=30.0), "attn_logit_softcapping"),
        (dict(model_type="mistral", num_local_experts=4), "has no MoE"),
        (dict(model_type="qwen3_moe", num_local_experts=4, mlp_only_layers=[7]), "mlp_only_layers"),
        (dict(model_type="llama", swiglu_alpha=1.0, swiglu_limit=7.0), "clamped SwiGLU"),
        (dict(model_type="qwen3", linear_num_key_heads=4), "linear_num_key_heads is"),
        (dict(model_type="qwen3", attn_output_gate=True), "model_type 'qwen3' has attn_output_gate=False"),
        (dict(model_type="qwen3_5_text", full_attention_interval=0), "full_attention_interval must be a positive"),
        (
            dict(model_type="qwen3_5_text", full_attention_interval=2, layer_types=["full_attention"] * 2),
            "give layer_types or full_attention_interval, not both",
        ),
        (dict(model_type="qwen3_5_text", num_local_experts=4), "model_type 'qwen3_5_text' has no MoE"),
        (dict(model_type="qwen3_5_text", sliding_window=8), "has no sliding-window attention"),
    ],
)
def test_a_recipe_that_mixes_families_fails_before_any_work(fields, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**SMALL, **fields)
    assert message in str(e.value)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
def test_an_eagle_head_for_a_gemma_target_is_refused_with_the_reason(name):
    from baton.common.eagle import EagleConfig, EagleHead

    with pytest.raises(ValueError, match="scaled embeddings, soft-capped logits or a second rope"):
        EagleHead(EagleConfig(config_from_hf(hf_dict(name)).to_dict()))
