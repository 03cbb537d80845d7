"""Helpers for the agent tests (tools, tool calls, reasoning): each family's chat format on a test
checkpoint, and one tool conversation that every family accepts.

The formats are Baton's own jinja templates (templates/*.jinja), each written for these tests in
its family's documented prompt format (the markers, roles and layout the family's parser and
reasoning parser read); gpt-oss has no template here: its checkpoint says model_type gpt_oss and
Baton renders it with openai-harmony (serve/openai/harmony_chat.py).

The base checkpoint is the session fixture `llama_dir` (a random Llama with a byte-level BPE
tokenizer of vocab 320): a family's special markers (<|im_start|>, [TOOL_CALLS], ...) are then
several ordinary tokens each, which changes nothing about what the template renders.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from baton.common.checkpoint import read_config, save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model

from ..openai_fixtures import with_chat_template

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = ("qwen3", "qwen3_coder", "llama3_1", "mistral", "deepseek_v3", "deepseek_v31", "gpt_oss", "deepseek_r1")
HARMONY = "gpt_oss"  # the family rendered by openai-harmony, not by a template
TEMPLATE_FAMILIES = tuple(f for f in FAMILIES if f != HARMONY)
# the --tool-call-parser / --reasoning-parser that reads each family's output (None: Baton has none)
TOOL_PARSER = {
    "qwen3": "hermes",
    "qwen3_coder": "qwen3_coder",
    "llama3_1": "llama3_json",
    "mistral": "mistral",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v31": None,
    "gpt_oss": "openai",
    "deepseek_r1": "deepseek_v3",
}
REASONING_PARSER = {"qwen3": "qwen3", "deepseek_r1": "deepseek_r1", "gpt_oss": "openai"}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
# Mistral's templates accept only call ids of 9 alphanumerics (what its parser generates)
CALL_ID = "a1B2c3D4e"
CALL_ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
TOOL_RESULT = '{"temperature": 21, "sky": "clear"}'


def family_template(family: str) -> str:
    """The text of a family's chat template (templates/<family>.jinja); gpt-oss has none."""
    if family not in TEMPLATE_FAMILIES:
        why = " (rendered by openai-harmony, not a template)" if family == HARMONY else ""
        raise ValueError(f"no template for family {family!r}{why}; one of {', '.join(TEMPLATE_FAMILIES)}")
    return (TEMPLATES / f"{family}.jinja").read_text()


def gpt_oss_checkpoint(src: Path, dst: Path) -> Path:
    """A small random gpt-oss checkpoint at `dst` with `src`'s tokenizer: config.json's model_type
    gpt_oss is what makes Baton render its chats with harmony, and the model is a real gpt-oss, so
    it also serves. Its context is long enough for harmony's system and developer messages spelt
    out in the small tokenizer's pieces."""
    base = read_config(src)
    cfg = ModelConfig(
        model_type="gpt_oss",
        vocab_size=base.vocab_size,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        num_local_experts=4,
        num_experts_per_tok=2,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
    )
    return save_model(dst, build_model(cfg, seed=0), tokenizer_dir=src)


def family_checkpoint(src: Path, dst: Path, family: str) -> Path:
    """A copy of checkpoint `src` at `dst` whose chat template is `family`'s (sha256 re-recorded);
    for gpt_oss, gpt_oss_checkpoint (harmony, no template)."""
    if family == HARMONY:
        return gpt_oss_checkpoint(Path(src), Path(dst))
    return with_chat_template(Path(src), Path(dst), family_template(family))


@pytest.fixture(scope="session")
def family_ckpts(llama_dir, tmp_path_factory) -> dict[str, Path]:
    """family -> a copy of llama_dir with that family's chat template, gpt_oss -> a small gpt-oss
    checkpoint with llama_dir's tokenizer (import this fixture into a test module to use it; built
    once per session)."""
    root = tmp_path_factory.mktemp("families")
    return {family: family_checkpoint(llama_dir, root / family, family) for family in FAMILIES}


def tool_conversation(call_id: str = CALL_ID, arguments: str = CALL_ARGUMENTS) -> list[dict]:
    """An agent's conversation in OpenAI's shape: system, user, an assistant turn that calls
    get_weather (content null, arguments as JSON text) and the tool's result; the model answers next."""
    return [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT},
    ]
