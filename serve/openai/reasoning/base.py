"""The one interface every reasoning parser implements: a thinking model's output split into its
reasoning (returned as `reasoning_content`, never in `content`) and its answer.

`split(text)` on the whole output and `feed(delta)`/`finish()` on the streamed pieces agree
exactly, wherever the text is cut. `end_text` is the marker that ends thinking: the engine applies
response_format and tool grammars only after it, and a thinking budget forces it (serve/sampling_params.Thinking).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningParser(ABC):
    """One response's reasoning split (streaming keeps its state on the object)."""

    name: ClassVar[str]  # the --reasoning-parser name (vLLM's)
    end_text: ClassVar[str]  # e.g. "</think>"

    def __init__(self, starts_in_reasoning: bool = True):
        """starts_in_reasoning: whether the output begins inside the thinking block (see
        `thinking_at_start`): e.g. False when the chat template already closed it
        (enable_thinking=False renders an empty <think></think>)."""
        self.starts_in_reasoning = starts_in_reasoning

    @classmethod
    @abstractmethod
    def thinking_at_start(cls, prompt_text: str, output_prefix: str = "") -> bool:
        """Whether generation after `prompt_text` starts inside thinking (an open block the prompt
        left unclosed, or a family whose models always think first)."""

    @abstractmethod
    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None if there was none, content)."""

    @abstractmethod
    def feed(self, delta: str) -> ReasoningDelta: ...

    @abstractmethod
    def finish(self) -> ReasoningDelta: ...
