"""The one interface every tool-call parser implements (one family's format per file).

A parser reads the text a model generated after a chat prompt rendered with `tools`, and splits it
into plain content and function calls. Two ways, which must agree exactly:
- `parse(text)`: the whole text at once (unary responses);
- `feed(delta)` ... `finish()`: the same text in pieces as the engine streams it. Each call's id and
  name go out once (in its first ToolCallDelta), then argument fragments; the content deltas
  concatenate to `parse(text).content` and each call's fragments to its `arguments`, wherever the
  text is cut (tests split it at every character boundary).
`structural_tag(...)` says how a call is written in this family's format, as an xgrammar structural
tag, so `tool_choice` "required" / a named function (and, where the family has call markers,
"auto") can be enforced while sampling instead of hoped for.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

_ID_CHARS = string.ascii_letters + string.digits


def call_id() -> str:
    """An OpenAI-style tool call id ("call_" + 24 random alphanumerics)."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it
    id: str = field(default_factory=call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    content: str  # the text outside any call ("" when there is none)
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """A piece of call `index` (0, 1, ... in the order the calls appear): id and name in its first
    delta only, then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        fn: dict = {}
        if self.name is not None:
            fn["name"] = self.name
        if self.arguments or self.name is not None:
            fn["arguments"] = self.arguments
        out["function"] = fn
        return out


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolParser(ABC):
    """One family's tool-call format. A parser object serves one response (one choice): streaming
    keeps its state on it. `tools` are the request's OpenAI tool dicts
    ({"type": "function", "function": {"name", "description", "parameters"}}), already validated."""

    name: ClassVar[str]  # the --tool-call-parser name (vLLM's)

    def __init__(self, tools: list[dict]):
        self.tools = tools
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}

    @abstractmethod
    def parse(self, text: str) -> ParsedMessage:
        """The whole output. A call that does not parse stays in `content` (never an exception)."""

    @abstractmethod
    def feed(self, delta: str) -> StreamDelta:
        """The next piece of the output; returns what can be sent now (text that may still turn
        out to be a call marker is held back until it is sure)."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """End of output: whatever was held back."""

    @abstractmethod
    def structural_tag(self, functions: list[dict], required: bool, parallel: bool) -> dict:
        """An xgrammar structural tag (the JSON object xgrammar.Grammar.from_structural_tag takes)
        for calls to `functions` (OpenAI function dicts: name, parameters) in this format.
        required=True: the output is one call (several if `parallel`) and nothing else; False
        ("auto"): free text, and any call the model starts is kept well-formed."""
