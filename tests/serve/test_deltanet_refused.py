"""Qwen3.5 / Qwen3-Next (Gated DeltaNet hybrids) train and convert, but the engine has no state slots
for their mixers yet: loading one for serving fails before any pool is built, naming the mixer."""

import pytest
import torch
import transformers
from baton.common.config import ConfigError
from baton.serve.engine import EngineConfig, LLMEngine


def test_serving_a_gated_deltanet_checkpoint_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"qwen3_5_text.*gated_deltanet \+ attention hybrid.*not served yet"):
        LLMEngine.from_checkpoint(tmp_path, EngineConfig(num_kv_blocks=8))
