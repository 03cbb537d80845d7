import pytest

from baton.common.config import ConfigError, ModelConfig, preset
from baton.common.hf import config_from_hf, config_to_hf

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_key_value_heads=3), r"num_attention_heads \(4\) must be divisible by num_key_value_heads \(3\)"),
        (dict(hidden_size=0), "hidden_size must be a positive integer"),
        (dict(head_dim=7), "head_dim must be even"),
        (dict(num_hidden_layers=1.5), "num_hidden_layers must be a positive integer"),
        (dict(rope_scaling={"rope_type": "longrope", "factor": 4}), "rope_scaling type 'longrope' is not supported"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8}), "llama3 rope_scaling needs 'low_freq_factor'"),
        (
            dict(num_local_experts=4, num_experts_per_tok=5),
            r"num_experts_per_tok \(5\) must be in 1..num_local_experts",
        ),
        (dict(num_local_experts=4, model_type="llama"), "model_type 'llama' has no MoE"),
        (dict(sliding_window=8, model_type="llama"), "model_type 'llama' has no sliding-window attention"),
        (dict(qkv_bias=True, model_type="llama"), "qkv_bias .* is exactly Qwen2's"),
        (dict(model_type="qwen2"), "qkv_bias .* is exactly Qwen2's"),
        (dict(sliding_window=0), "sliding_window must be a positive integer"),
        (dict(layer_types=["full_attention"]), "layer_types has 1 entries for 2 layers"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "sliding_window is not set"),
        (dict(hidden_act="gelu"), "hidden_act must be one of"),
        (dict(torch_dtype="float8"), "torch_dtype must be one of"),
        (dict(model_type="gpt2"), "model_type must be one of"),
    ],
)
def test_invalid_configs_fail_with_clear_message(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**SMALL, **overrides})


def test_defaults_and_inferred_family():
    c = ModelConfig(**SMALL)
    assert (c.num_key_value_heads, c.head_dim, c.model_type) == (4, 8, "llama")
    assert ModelConfig(**SMALL, sliding_window=16).model_type == "mistral"
    assert ModelConfig(**SMALL, qkv_bias=True).model_type == "qwen2"
    assert ModelConfig(**SMALL, num_local_experts=4).model_type == "mixtral"
    assert ModelConfig(**SMALL, num_key_value_heads=1).num_key_value_heads == 1  # MQA


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="unknown model config key.*hiden_size"):
        ModelConfig.from_dict({**SMALL, "hiden_size": 3})
    assert ModelConfig.from_dict(ModelConfig(**SMALL).to_dict()) == ModelConfig(**SMALL)


def test_hf_dict_round_trip_for_every_family():
    for extra in (
        {},
        dict(sliding_window=8),
        dict(qkv_bias=True),
        dict(num_local_experts=4),
        dict(qkv_bias=True, sliding_window=4, layer_types=["full_attention", "sliding_attention"]),
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ):
        c = ModelConfig(**SMALL, **extra)
        assert config_from_hf(config_to_hf(c)) == c, extra


def test_legacy_hf_rope_keys_are_read():
    d = config_to_hf(ModelConfig(**SMALL))
    del d["rope_parameters"]
    d.update(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    c = config_from_hf(d)
    assert c.rope_theta == 5e5 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_unsupported_hf_configs():
    with pytest.raises(ConfigError, match="unsupported model_type 'gpt2'"):
        config_from_hf({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="mlp_bias"):
        config_from_hf({**config_to_hf(ModelConfig(**SMALL)), "mlp_bias": True})


def test_presets():
    assert preset("demo").num_parameters() > 0
    with pytest.raises(ConfigError, match="unknown model preset 'nope'"):
        preset("nope")
