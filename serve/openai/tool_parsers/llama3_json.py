"""Llama 3.1/3.2 JSON tool calls (vLLM's `llama3_json` parser; Meta's JSON-based tool calling):

    [<|python_tag|>]{"name": "NAME", "parameters": {ARGUMENTS}}[; {"name": ..., "parameters": ...}]

Meta's prompt asks for the bare object (`"parameters"`; `"arguments"` is taken too, as vLLM
does); `<|python_tag|>` may lead it; several calls are separated by "; ". A call goes out (id
and name) once `{"name": "NAME", "parameters": {` is read with a declared NAME, wherever it
starts; its arguments then stream through a JSON scanner (streaming.JsonStream) and come out as
json.dumps writes them. A `{` that does not open such a head is text. After the arguments the
call object's closing brace and one ";" separator are framing; anything else is content again.
Arguments that break off (max_tokens) or stop being JSON end the call there, closed into valid
JSON (the name has been streamed by then, so unary parsing does the same); the rest of a broken
call, up to a ";" that may start the next one, is dropped.

Differences from vLLM 0.32, on purpose: text around the calls is content (vLLM's unary parse
drops it and returns no content; its streaming returns everything as content unless the output
starts with the call); a `{` in prose does not turn the whole answer into content (vLLM's unary
parse gives up on the first object without "name"); streaming and unary agree exactly.
"""

from __future__ import annotations

import regex
from baton.serve.openai.tool_parsers.streaming import IncrementalToolParser, held_suffix, match_head, object_schema

PYTHON_TAG = "<|python_tag|>"
HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*\{')
CLOSE = regex.compile(r"\s*\}\s*(?:;\s*)?")  # the call object's end and the separator before a next call


class Parser(IncrementalToolParser):
    name = "llama3_json"

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._state = "content"  # content | head | args | tail | skip
        self._opener = ""  # the <|python_tag|> in front of a head being read ("" for a bare "{")

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == "content":
            starts = [i for i in (buf.find("{"), buf.find(PYTHON_TAG)) if i >= 0]
            if not starts:
                keep = 0 if final else held_suffix(buf, (PYTHON_TAG,))
                self._content(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return False
            at = min(starts)
            self._content(buf[:at])
            self._opener = PYTHON_TAG if buf.startswith(PYTHON_TAG, at) else ""
            self._buf, self._state = buf[at + len(self._opener) :], "head"
            return True
        if self._state == "head":
            wait, m = match_head(HEAD, buf, final)
            if wait:
                return False
            if m and self.known(m.group(1)):
                self._begin_json_call(m.group(1), m.end())
                self._state = "args"
            else:  # not a call: the tag, or the "{", is text; the rest is read as content again
                skip = len(self._opener) or 1
                self._content((self._opener + buf)[:skip])
                self._buf = (self._opener + buf)[skip:]
                self._state = "content"
            return True
        if self._state == "args":
            if not self._json_arguments(final):
                return False
            self._state = "skip" if self._json.failed else "tail"
            return True
        if self._state == "skip":  # the rest of a broken call, up to the ";" before a next call
            at = buf.find(";")
            self._buf = buf[at + 1 :] if at >= 0 else ""
            if at < 0:
                return False
            self._state = "content"
            return True
        # tail: the call object's "}" and a "; " separator are framing; other text is content
        m = CLOSE.match(buf, partial=True)
        if m and m.partial and not final:
            return False
        if m and m.end() == len(buf) and not final:
            return False  # whitespace after ";" or "}": a next call or text may follow
        self._buf = buf[m.end() :] if m else buf
        self._state = "content"
        return True

    def structural_tag(self, functions: list[dict], required: bool, parallel: bool) -> dict:
        tags = [
            {
                "type": "tag",
                "begin": f'{{"name": "{f["name"]}", "parameters": ',
                "content": {"type": "json_schema", "json_schema": object_schema(f)},
                "end": "}",
            }
            for f in functions
        ]
        if required:  # calls only, separated as in Meta's examples
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "; ", "at_least_one": True}
        else:
            fmt = {"type": "triggered_tags", "triggers": ['{"name": '], "tags": tags}
        fmt["stop_after_first"] = not parallel
        return {"type": "structural_tag", "format": fmt}
