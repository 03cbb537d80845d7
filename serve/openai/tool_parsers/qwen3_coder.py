"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder` parser; Qwen3-Coder's chat template):

    [content]

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

The template writes a string value as is and any other value as JSON (tojson), each between one
newline after `<parameter=P>` and one before `</parameter>`: those two newlines are framing. The
values come back typed by the function's JSON schema for P (`type`, a list of types, `enum`,
`anyOf`/`oneOf`/`allOf`): a P that can only be a string (or that the schema does not declare) is
the raw text, streamed as it comes; otherwise the text is read as, in this order, null ("null"),
an integer, a finite number (an integral one as an integer, as Qwen's and vLLM's parsers do), a
boolean (true/false, any case), an object or array (JSON, else a Python literal: Qwen's own
parser's fallback), and failing all of those, the string. Such a value goes out once complete.

A call goes out (id and name) once `<tool_call><function=NAME>` is read with a declared NAME. A
value ends at `</parameter>`, or (the model left it open) at the next `<parameter=`,
`</function>` or `</tool_call>`, as in Qwen's reference parser; text between parameters is
dropped. A `<tool_call>` not followed by `<function=NAME>` is not a call: it stays in the
content, verbatim. Arguments are the JSON object json.dumps writes, parameters in the order
written.

Differences from vLLM 0.32, on purpose: whitespace next to a call is template framing, not
content (vLLM keeps it); a bare `<function=` without `<tool_call>` in the content is text (vLLM
takes it as a call); streaming and unary agree exactly.
"""

from __future__ import annotations

import ast
import json
import math

import regex
from baton.serve.openai.tool_parsers.streaming import (
    IncrementalToolParser,
    dump_string,
    held_suffix,
    match_head,
    object_schema,
)

START, END = "<tool_call>", "</tool_call>"
FUNC_END, PARAM, PARAM_END = "</function>", "<parameter=", "</parameter>"
HEAD = regex.compile(r"\s*<function=([^<>\s]+)>")
PARAM_HEAD = regex.compile(r"<parameter=([^<>]*)>")
VALUE_ENDS = (PARAM_END, PARAM, FUNC_END, END)  # what ends a parameter's value
BODY_MARKS = (PARAM, FUNC_END, END, START)  # what the text between parameters is scanned for


def schema_types(schema: object) -> set[str]:
    """The JSON types a schema allows ({"string"} when it says nothing about types)."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    for t in declared if isinstance(declared, list) else [declared]:
        if isinstance(t, str):
            types.add(t)
    for value in schema.get("enum") or []:
        types.add(_json_type(value))
    if "const" in schema:
        types.add(_json_type(schema["const"]))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or []:
            types |= schema_types(sub)
    return types or {"string"}


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {dict: "object", list: "array"}.get(type(value), "string")


def typed_value(text: str, types: set[str]) -> object:
    """A parameter's text as the first of the schema's types it reads as (see the module doc)."""
    s = text.strip()
    if "null" in types and s == "null":
        return None
    if "integer" in types and regex.fullmatch(r"-?\d+", s):
        return int(s)
    if "number" in types:
        try:
            x = float(s)
        except ValueError:
            x = math.nan
        if math.isfinite(x):
            return int(x) if x.is_integer() and abs(x) < 2**53 else x
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    for kind, cls in (("object", dict), ("array", list)):
        if kind in types:
            for read in (json.loads, ast.literal_eval):
                try:
                    value = read(s)
                except (ValueError, SyntaxError, RecursionError, TypeError, MemoryError):
                    continue
                if isinstance(value, cls) and _finite(value):
                    return value
    return text


def _finite(value: object) -> bool:
    """Whether json.dumps writes it as valid JSON (no NaN/Infinity, no non-JSON Python values)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _finite(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return value is None or isinstance(value, (str, int, bool))


class Parser(IncrementalToolParser):
    name = "qwen3_coder"

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._state = "content"  # content | head | body | value | tail
        self._props: dict = {}  # the current function's parameter schemas
        self._first = True  # no parameter written yet in the current call
        self._param = ""  # the parameter being read
        self._streamed = False  # its value streams as a string (else it is buffered in _raw)
        self._raw = ""  # a buffered value's text
        self._lead = True  # the value's first character (a framing newline) is still to come

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
                self._begin_call(m.group(1))
                props = (self.schemas.get(m.group(1)) or {}).get("properties")
                self._props = props if isinstance(props, dict) else {}
                self._first = True
                self._arguments("{")
                self._buf, self._state = buf[m.end() :], "body"
            else:  # not a call: the marker is text, and what follows is read as content again
                self._content(START)
                self._state = "content"
            return True
        if self._state == "body":
            return self._body(final)
        if self._state == "value":
            return self._value(final)
        # tail: after </function>, up to </tool_call> (or a next <tool_call>) is dropped
        ends = [i for i in (buf.find(END), buf.find(START)) if i >= 0]
        if ends:
            at = min(ends)
            self._buf = buf[at + len(END) :] if buf.startswith(END, at) else buf[at:]
            self._state = "content"
            return True
        self._buf = "" if final else buf[len(buf) - held_suffix(buf, (END, START)) :]
        return False

    def _body(self, final: bool) -> bool:
        """Between parameters: the next <parameter=P>, or the call's end."""
        buf = self._buf
        marks = [(i, m) for m in BODY_MARKS if (i := buf.find(m)) >= 0]
        if not marks:
            if final:
                self._end_call("", "content")
                return True
            self._buf = buf[len(buf) - held_suffix(buf, BODY_MARKS) :]
            return False
        at, mark = min(marks)
        if mark == PARAM:
            wait, m = match_head(PARAM_HEAD, buf, final, at)
            if wait:
                self._buf = buf[at:]
                return False
            if not m:  # "<parameter=" never closed: dropped with the rest of the call
                self._buf = buf[at + len(PARAM) :]
                return True
            self._begin_param(m.group(1))
            self._buf, self._state = buf[m.end() :], "value"
        elif mark == FUNC_END:
            self._end_call(buf[at + len(FUNC_END) :], "tail")
        else:  # </tool_call> (or a new <tool_call>) without </function>
            self._end_call(buf[at + len(END) :] if mark == END else buf[at:], "content")
        return True

    def _begin_param(self, name: str) -> None:
        self._param, self._raw, self._lead = name, "", True
        self._streamed = schema_types(self._props.get(name)) == {"string"}
        if self._streamed:
            self._arguments(self._key() + '"')

    def _key(self) -> str:
        sep = "" if self._first else ", "
        self._first = False
        return sep + dump_string(self._param) + ": "

    def _value(self, final: bool) -> bool:
        buf = self._buf
        ends = [(i, m) for m in VALUE_ENDS if (i := buf.find(m)) >= 0]
        end = min(ends) if ends else None
        avail = buf[: end[0]] if end else buf if final else buf[: len(buf) - held_suffix(buf, VALUE_ENDS)]
        closed = end is not None or final
        if self._lead:  # the template's newline after <parameter=P>
            if not avail and not closed:
                return False
            if avail.startswith("\n"):
                avail, buf = avail[1:], buf[1:]
                end = (end[0] - 1, end[1]) if end else None
            self._lead = False
        # and the one before </parameter>: dropped once the value is closed, held until then
        text = avail[:-1] if avail.endswith("\n") else avail
        if self._streamed:
            self._arguments(dump_string(text)[1:-1])
        else:
            self._raw += text
        if not closed:
            self._buf = buf[len(text) :]
            return False
        if self._streamed:
            self._arguments('"')
        else:
            value = typed_value(self._raw, schema_types(self._props.get(self._param)))
            self._arguments(self._key() + json.dumps(value, ensure_ascii=False))
        self._buf = buf[end[0] + len(PARAM_END) :] if end and end[1] == PARAM_END else buf[end[0] :] if end else ""
        self._state = "body"
        return True

    def _end_call(self, rest: str, state: str) -> None:
        self._arguments("}")
        self._buf, self._state = rest, state

    def structural_tag(self, functions: list[dict], required: bool, parallel: bool) -> dict:
        tags = [
            {
                "type": "tag",
                "begin": f"{START}\n<function={f['name']}>\n",
                "content": {
                    "type": "json_schema",
                    "json_schema": object_schema(f),
                    "style": "qwen_xml",
                    # what ends a value in the parser: xgrammar keeps "</parameter>" out of string
                    # values itself, but not out of strings inside an object or array value
                    "excludes": list(VALUE_ENDS),
                },
                "end": f"{FUNC_END}\n{END}",  # the newline before it: the parameters' trailing whitespace
            }
            for f in functions
        ]
        if required:  # calls only, one per line as the template writes them
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
        else:
            fmt = {"type": "triggered_tags", "triggers": [START], "tags": tags}
        fmt["stop_after_first"] = not parallel
        return {"type": "structural_tag", "format": fmt}
