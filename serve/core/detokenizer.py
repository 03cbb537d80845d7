"""Incremental detokenization that never emits half a UTF-8 character.

Byte-level BPE tokens are byte fragments: a character can span tokens, and a token's text can
depend on its neighbours. Like vLLM, we decode a short window of recent ids twice (with and
without the newest tokens) and emit only the difference, holding back while the tail decodes to
U+FFFD (an incomplete character).
"""

from __future__ import annotations

from baton.common.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] were already turned into text
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.text += delta
            # The emitted tokens end on a character boundary: they become the next left context.
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence, emit whatever is left (an incomplete character as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        rest = self._decode(self.ids[self.prefix_offset :])[len(prefix_text) :]
        self.text += rest
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return rest
