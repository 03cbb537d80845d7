"""Hermes-style JSON tool calls, as Qwen2.5 and Qwen3 write them (vLLM's `hermes` parser):

    [content]
    <tool_call>
    {"name": "NAME", "arguments": {ARGUMENTS}}
    </tool_call>
    <tool_call>
    ...

(`<tool_call>`/`</tool_call>` are single tokens; Qwen's template puts each call on its own lines.)
A call goes out (id and name) once `<tool_call>{"name": "NAME", "arguments": {` is read with a
declared NAME; its arguments then stream through a JSON scanner (streaming.JsonStream) and come
out as json.dumps writes them. Whatever follows the arguments up to `</tool_call>` (the closing
brace) is dropped. A `<tool_call>` whose text is not of that form (not JSON, "name" not first, an
unknown function, "arguments" not an object) is not a call: it stays in the content, verbatim.
Arguments that break off (max_tokens) or stop being JSON end the call there, closed into valid
JSON: the name has been streamed by then, so unary parsing does the same.

Differences from vLLM 0.32, on purpose: whitespace next to a call is template framing, not
content (vLLM keeps the newline before the first call, its own TODO says it should not); text
after the calls is content (vLLM drops it); one malformed call stays content without taking the
well-formed ones with it (vLLM's unary parse returns everything as content then); streaming and
unary agree exactly (vLLM streams the arguments as written, its unary re-serializes them).
"""

from __future__ import annotations

import regex
from baton.serve.openai.tool_parsers.streaming import IncrementalToolParser, held_suffix, match_head, object_schema

START, END = "<tool_call>", "</tool_call>"
# a call's head up to the "{" that opens its arguments ("name" first, as the template renders it)
HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*\{')


class Parser(IncrementalToolParser):
    name = "hermes"

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._state = "content"  # content | head | args | tail

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "content":
            if not self._content_until(START, final):
                return False
            self._state = "head"
            return True
        if self._state == "head":
            wait, m = match_head(HEAD, buf, final)
            if wait:
                return False
            if m and self.known(m.group(1)):
                self._begin_json_call(m.group(1), m.end())
                self._state = "args"
            else:  # not a call: the marker is text, and what follows is read as content again
                self._content(START)
                self._state = "content"
            return True
        if self._state == "args":
            if not self._json_arguments(final):
                return False
            self._state = "tail"
            return True
        # tail: the rest of the call's text up to </tool_call> (or a next <tool_call>) is dropped
        ends = [i for i in (buf.find(END), buf.find(START)) if i >= 0]
        if ends:
            at = min(ends)
            self._buf = buf[at + len(END) :] if buf.startswith(END, at) else buf[at:]
            self._state = "content"
            return True
        self._buf = "" if final else buf[len(buf) - held_suffix(buf, (END, START)) :]
        return False

    def structural_tag(self, functions: list[dict], required: bool, parallel: bool) -> dict:
        tags = [
            {
                "type": "tag",
                "begin": f'{START}\n{{"name": "{f["name"]}", "arguments": ',
                "content": {"type": "json_schema", "json_schema": object_schema(f)},
                "end": "}\n" + END,
            }
            for f in functions
        ]
        if required:  # calls only, one per line as the template writes them
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
        else:
            fmt = {"type": "triggered_tags", "triggers": [START], "tags": tags}
        fmt["stop_after_first"] = not parallel
        return {"type": "structural_tag", "format": fmt}
