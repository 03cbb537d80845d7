"""DeepSeek-V3's tool calls (vLLM's `deepseek_v3` parser; DeepSeek-V3's and R1's chat template):

    [content]<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {ARGUMENTS}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME2 ...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(each marker is one token, spelled with full-width bars "｜" and "▁" (U+2581) for spaces; the
template separates calls with "\\n"). A call goes out (id and name) once its head,
`TYPE<｜tool▁sep｜>NAME\\n```json\\n{`, is read with a declared NAME; its arguments then stream
through a JSON scanner (streaming.JsonStream) and come out as json.dumps writes them; the rest of
the call up to <｜tool▁call▁end｜> (the closing fence) is dropped. A call whose head is not of that
form (no separator, no fence, an unknown function) is no call: the block's text stays in the
content, verbatim, markers included, and a well-formed call after it still parses.

Differences from vLLM 0.32, on purpose: arguments may span lines (vLLM's regex has no DOTALL,
so a pretty-printed object is no call there); whitespace next to the calls is the template's
framing, not content (streaming.Framing); text after the calls block is content (vLLM's unary
parse drops it); a call without a name is content (vLLM returns a call named ""); streaming and
unary agree exactly.
"""

from __future__ import annotations

import regex
from baton.serve.openai.tool_parsers.hermes import object_schema
from baton.serve.openai.tool_parsers.streaming import IncrementalToolParser, held_suffix

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"
# a call's head, from after <｜tool▁call▁begin｜> to the "{" that opens its arguments
HEAD = regex.compile(r"[^\n<]*" + regex.escape(SEP) + r"([^\s<]+)" + regex.escape(FENCE_OPEN) + r"\s*\{")
HEAD_LIMIT = 256  # a head longer than this is none (a name is at most 64 characters)


def first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(position, marker) of the marker that occurs first in `text`; (-1, "") if none does."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, "")


class Parser(IncrementalToolParser):
    name = "deepseek_v3"

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._state = "content"  # content | block | head | args | tail
        # <｜tool▁calls▁begin｜>, held until a call in its block parses: a block that turns out
        # to be text goes to the content whole, markers included
        self._opening = ""
        self._raw_block = False  # the block's opening went out as content

    def _text(self, text: str) -> None:
        if self._opening and text.strip():  # the block is text: its opening marker goes first
            text, self._opening, self._raw_block = self._opening + text, "", True
        self._content(text)

    def _step(self, final: bool) -> bool:
        buf, state = self._buf, self._state
        if state in ("content", "block"):
            markers = (CALLS_BEGIN,) if state == "content" else (CALL_BEGIN, CALLS_END)
            at, marker = first(buf, markers)
            if at < 0:
                keep = 0 if final else held_suffix(buf, markers)
                self._text(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return False
            self._text(buf[:at])
            self._buf = buf[at + len(marker) :]
            if marker == CALLS_BEGIN:
                self._opening, self._raw_block, self._state = marker, False, "block"
            elif marker == CALLS_END:
                if self._raw_block:
                    self._text(marker)
                self._opening, self._state = "", "content"
            else:
                self._state = "head"
            return True
        if state == "head":
            m = HEAD.match(buf, partial=True)
            if m and m.partial and not final and len(buf) <= HEAD_LIMIT:
                return False
            if m and not m.partial and m.end() <= HEAD_LIMIT and self.known(m.group(1)):
                self._opening, self._raw_block = "", False  # a calls block after all: its markers are no text
                self._begin_json_call(m.group(1), m.end())
                self._state = "args"
            else:  # no call: its text is read on as the block's text (up to the block's next marker)
                self._text(CALL_BEGIN)
                self._state = "block"
            return True
        if state == "args":
            if not self._json_arguments(final):
                return False
            self._state = "tail"
            return True
        # tail: the closing fence (and anything the arguments left) up to <｜tool▁call▁end｜>
        at, marker = first(buf, (CALL_END, CALL_BEGIN, CALLS_END))
        if at < 0:
            self._buf = "" if final else buf[len(buf) - held_suffix(buf, (CALL_END, CALL_BEGIN, CALLS_END)) :]
            return False
        self._buf = buf[at + len(CALL_END) :] if marker == CALL_END else buf[at:]
        self._state = "block"
        return True

    def structural_tag(self, functions: list[dict], required: bool, parallel: bool) -> dict:
        """Calls as the template writes them (xgrammar's built-in deepseek_r1 tag has this
        shape). required: the calls block alone; auto: text until <｜tool▁calls▁begin｜>, then a
        well-formed block that ends the output (nothing follows it in the template either)."""
        calls = {
            "type": "tags_with_separator",
            "tags": [
                {
                    "type": "tag",
                    "begin": f"{CALL_BEGIN}function{SEP}{f['name']}{FENCE_OPEN}",
                    "content": {"type": "json_schema", "json_schema": object_schema(f)},
                    "end": FENCE_CLOSE + CALL_END,
                }
                for f in functions
            ],
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
        block = {"type": "tag", "begin": CALLS_BEGIN, "content": calls, "end": CALLS_END}
        if required:
            return {"type": "structural_tag", "format": block}
        fmt = {
            "type": "triggered_tags",
            "triggers": [CALLS_BEGIN],
            "tags": [block],
            "stop_after_first": True,
            "excludes": [CALL_BEGIN, CALL_END, CALLS_END, SEP],  # call markers outside a block are no call
        }
        return {"type": "structural_tag", "format": fmt}
