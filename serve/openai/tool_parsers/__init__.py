"""Tool-call parsers by their --tool-call-parser name (vLLM's names), one family format per file.

Imported by name when chosen, so a server pays only for its own parser's imports (harmony's
vocabulary, for one)."""

from __future__ import annotations

import importlib

from baton.serve.openai.tool_parsers.base import ToolParser

# name -> module under baton.serve.openai.tool_parsers; each module defines one ToolParser subclass `Parser`
TOOL_PARSERS = {
    "hermes": "hermes",
    "qwen3_coder": "qwen3_coder",
    "llama3_json": "llama3_json",
    "mistral": "mistral",
    "deepseek_v3": "deepseek_v3",
    "openai": "harmony",
}
# the parser a checkpoint's family uses when --tool-call-parser is not given (config.json's model_type)
FAMILY_PARSERS = {
    "qwen2": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
    "mixtral": "mistral",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "openai",
}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser class for a --tool-call-parser name; ValueError listing the names otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    module = importlib.import_module(f"baton.serve.openai.tool_parsers.{TOOL_PARSERS[name]}")
    return module.Parser


def default_tool_parser(model_type: str) -> str | None:
    """The family's parser name, or None when the family has no known tool-call format."""
    return FAMILY_PARSERS.get(model_type)
