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
