"""--reasoning-parser deepseek_r1: thinking closed by </think>, then the answer.

DeepSeek-R1's chat template ends the prompt with `<｜Assistant｜><think>\\n`, so the output starts
inside the thinking and only closes it; R1 models think first even where a template does not open
the block. The split, as vLLM's deepseek_r1 parser makes it:
- the thinking runs to the first </think>; everything after it is the answer, verbatim (a later
  </think> or <think> included);
- a <think> inside the thinking is a marker, dropped (the model re-opening its block);
- no </think>: the whole output is thinking (a length-cut answer has no content yet);
- a prompt that closed the block at its end (thinking_at_start False): the whole output is answer.
Where vLLM's own paths disagree, this follows its token-by-token stream, the path a streaming
server can keep in step with its unary answer: vLLM's unary parse ignores the prompt, drops any
text before the first <think> and keeps a later <think> as text; its stream does none of that.

`ThinkParser` is that format; qwen3 extends it. Its streaming scans the text once, holding back
only a tail that could still become a marker, so `split` (plain string search, written separately)
and `feed`/`finish` agree at every cut.
"""

from __future__ import annotations

from typing import ClassVar

from baton.serve.openai.reasoning.base import ReasoningDelta, ReasoningParser

OPEN, CLOSE = "<think>", "</think>"


class ThinkParser(ReasoningParser):
    """<think>...</think> reasoning."""

    end_text = CLOSE
    # markers that also end the thinking and begin the answer (kept in it), e.g. Qwen3's <tool_call>
    answer_starts: ClassVar[tuple[str, ...]] = ()

    def __init__(self, starts_in_reasoning: bool = True):
        super().__init__(starts_in_reasoning)
        self._thinking = starts_in_reasoning  # streaming: still inside the thinking
        self._held = ""  # streamed text not yet sent: the start of a marker, perhaps

    @classmethod
    def thinking_at_start(cls, prompt_text: str, output_prefix: str = "") -> bool:
        """True where the prompt (with any assistant prefix) leaves a <think> block open, or ends
        with no block at all (these models think first); False where it closed one at its very
        end (Qwen3's enable_thinking=false renders an empty <think></think>)."""
        text = prompt_text + output_prefix
        if text.rfind(OPEN) > text.rfind(CLOSE):
            return True
        return not text.rstrip().endswith(CLOSE)

    def split(self, text: str) -> tuple[str | None, str]:
        if not self.starts_in_reasoning:
            return None, text
        end, skip = len(text), 0
        if (i := text.find(CLOSE)) >= 0:
            end, skip = i, len(CLOSE)
        for marker in self.answer_starts:
            if 0 <= (j := text.find(marker)) < end:
                end, skip = j, 0
        return text[:end].replace(OPEN, "") or None, text[end + skip :]

    def feed(self, delta: str) -> ReasoningDelta:
        if not self._thinking:
            return ReasoningDelta(content=delta)
        out = ReasoningDelta()
        text = self._held + delta
        markers = (OPEN, CLOSE, *self.answer_starts)
        while self._thinking:
            hits = [(i, m) for m in markers if (i := text.find(m)) >= 0]
            if not hits:
                break
            i, marker = min(hits)
            out.reasoning += text[:i]
            if marker == OPEN:
                text = text[i + len(OPEN) :]
            else:  # the thinking ends: </think> is dropped, an answer marker begins the answer
                self._thinking = False
                out.content += text[i + len(CLOSE) :] if marker == CLOSE else text[i:]
                text = ""
        if self._thinking:
            keep = _marker_start(text, markers)
            out.reasoning += text[: len(text) - keep]
            text = text[len(text) - keep :]
        self._held = text
        return out

    def finish(self) -> ReasoningDelta:
        """A held tail that never became a marker is thinking text."""
        held, self._held = self._held, ""
        return ReasoningDelta(reasoning=held)


def _marker_start(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that a marker begins with (0 if none)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class Parser(ThinkParser):
    name = "deepseek_r1"
