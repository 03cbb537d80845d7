"""Reasoning parsers by their --reasoning-parser name (vLLM's names), one format per file."""

from __future__ import annotations

import importlib

from baton.serve.openai.reasoning.base import ReasoningParser

# name -> module under baton.serve.openai.reasoning; each module defines one ReasoningParser subclass `Parser`
REASONING_PARSERS = {"qwen3": "qwen3", "deepseek_r1": "deepseek_r1", "openai": "harmony"}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser class for a --reasoning-parser name; ValueError listing the names otherwise."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}")
    module = importlib.import_module(f"baton.serve.openai.reasoning.{REASONING_PARSERS[name]}")
    return module.Parser
