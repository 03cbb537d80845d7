"""Mistral's tool calls (vLLM's `mistral` parser), in the two forms mistral-common's tokenizer
versions write:

- v11 and later ([ARGS] in the vocabulary: Mistral Small 3.2, Magistral, Devstral, Mistral
  Medium 3): one `[TOOL_CALLS]NAME[ARGS]{ARGUMENTS}` per call, calls back to back. v11's encoder
  writes `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}` for a call that has an id (read here, the id
  dropped: ids are the server's to keep unique; vLLM does not read it), and some models write
  `[TOOL_CALLS]NAME{...}` with no [ARGS] (vLLM reads that too).
- v2 to v7 (Mistral-7B-Instruct-v0.3, Mixtral-8x22B-Instruct, Mistral Small/Large 2):
  `[TOOL_CALLS] [{"name": NAME, "arguments": {...}}, ...]`, one JSON list (a bare object is one
  call; mistral-common also writes an "id" key from v3 on, ignored here).

The text says which: after [TOOL_CALLS] a "[" or "{" opens the JSON list, anything else is a
name. v11 arguments stream through a JSON scanner (streaming.JsonStream) and come out as
json.dumps writes them (the form mistral-common renders them in); they end where the first JSON
object does, and text after it is content (Mistral writes no end marker). A v2-v7 list goes out
whole once it closes: a prefix of one JSON document is no call yet. Call ids are 9 alphanumerics,
the form Mistral's chat templates check when the calls come back in the conversation.

Not a call, so content, verbatim from [TOOL_CALLS] on: a name that is not a declared function,
no "{" after [ARGS], a list that does not parse, never closes, or holds an item that is no call.
Differences from vLLM 0.32, on purpose: the [CALL_ID] form; text after the arguments is content
(vLLM drops it); whitespace next to a call is framing (streaming.Framing; vLLM's unary parse
strips content before a call, its streaming does not); an unknown or malformed name is content
(vLLM returns it as a call); a "[TOOL_CALLS]" inside a JSON string is text (vLLM cuts the call
there); a v2-v7 list's calls arrive when the list closes (vLLM streams them item by item and
returns the arguments as written, re-serialising them only in its unary parse).
"""

from __future__ import annotations

import json
import secrets
import string

from baton.serve.openai.tool_parsers.hermes import object_schema
from baton.serve.openai.tool_parsers.streaming import IncrementalToolParser, held_suffix

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_ALNUM = string.ascii_letters + string.digits
_NAME = frozenset(_ALNUM + "_-.")
NAME_LIMIT = 64  # OpenAI's limit on function names (and ours on a [CALL_ID]'s id)


def mistral_call_id() -> str:
    """A call id of the form Mistral's chat templates require: 9 alphanumerics."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class Parser(IncrementalToolParser):
    name = "mistral"

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._state = "content"  # content | start | name | call_id | args_start | args | list
        self._raw = ""  # the call's text from [TOOL_CALLS] on: the content if it turns out no call
        self._name = ""
        self._word = 0  # characters of the name, or of the [CALL_ID] id, read so far
        self._list = _Extent()  # the v2-v7 list's extent

    def _begin_call(self, name: str) -> None:
        super()._begin_call(name)
        self._out.tool_calls[-1].id = mistral_call_id()
        self._raw = ""

    def _take_raw(self, n: int) -> None:
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _no_call(self) -> bool:
        """What was read since [TOOL_CALLS] is no call: content, and the rest is read as content."""
        self._content(self._raw)
        self._raw, self._state = "", "content"
        return True

    def _step(self, final: bool) -> bool:
        buf, state = self._buf, self._state
        if state == "content":
            at = buf.find(BOT)
            if at < 0:
                keep = 0 if final else held_suffix(buf, (BOT,))
                self._content(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return False
            self._content(buf[:at])
            self._buf, self._raw, self._state = buf[at:], "", "start"
            self._take_raw(len(BOT))
            return True
        if state == "start":
            body = buf.lstrip()
            if not body or (BOT.startswith(body) and body != BOT):  # "[" may open a list or a marker
                return self._no_call() if final else False
            self._take_raw(len(buf) - len(body))
            if body.startswith(BOT):  # "[TOOL_CALLS][TOOL_CALLS]": one marker
                self._take_raw(len(BOT))
            elif body[0] in "[{":
                self._list, self._state = _Extent(), "list"
            else:
                self._name, self._word, self._state = "", 0, "name"
            return True
        if state in ("name", "call_id"):
            return self._name_or_id(final)
        if state == "args_start":
            body = buf.lstrip()
            if not body:
                return self._no_call() if final else False
            if body[0] != "{" or not self.known(self._name):
                return self._no_call()
            self._take_raw(len(buf) - len(body))
            self._begin_json_call(self._name, 1)
            self._state = "args"
            return True
        if state == "args":
            if not self._json_arguments(final):
                return False
            self._state = "content"  # text after the arguments object is content
            return True
        return self._legacy_list(final)

    def _name_or_id(self, final: bool) -> bool:
        buf, naming = self._buf, self._state == "name"
        chars = _NAME if naming else _ALNUM
        n = 0
        while n < len(buf) and buf[n] in chars:
            n += 1
        if naming:
            self._name += buf[:n]
        self._word += n
        self._take_raw(n)
        rest = self._buf
        if self._word > NAME_LIMIT:
            return self._no_call()
        if not rest:
            return self._no_call() if final else False
        if self._word and rest.startswith(ARGS):
            self._take_raw(len(ARGS))
            self._state = "args_start"
            return True
        if naming and self._word and rest.startswith(CALL_ID):
            self._take_raw(len(CALL_ID))
            self._word, self._state = 0, "call_id"
            return True
        if naming and self._word and rest[0] == "{":  # NAME{...}: the brace opens the arguments
            if not self.known(self._name):
                return self._no_call()
            self._begin_json_call(self._name, 1)
            self._state = "args"
            return True
        if not final and any(m.startswith(rest) for m in (ARGS, CALL_ID)):
            return False  # "[AR": the marker may still complete
        return self._no_call()

    def _legacy_list(self, final: bool) -> bool:
        n = self._list.scan(self._buf)
        self._take_raw(n)
        if not self._list.done:
            return self._no_call() if final else False
        calls = self._legacy_calls(self._raw[len(BOT) :])
        if calls is None:
            return self._no_call()
        for name, arguments in calls:
            self._begin_call(name)
            self._arguments(arguments)
        self._state = "content"
        return True

    def _legacy_calls(self, text: str) -> list[tuple[str, str]] | None:
        """The calls of a v2-v7 list (or bare object) as (name, arguments JSON); None if it is
        not a list of calls to declared functions."""
        try:
            doc = json.loads(text.lstrip().removeprefix(BOT))
        except ValueError:
            return None
        calls = []
        for item in doc if isinstance(doc, list) else [doc]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not self.known(item["name"]):
                return None
            args = item.get("arguments", {})
            if isinstance(args, str):  # arguments written as a JSON string: its text is the object
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            calls.append((item["name"], json.dumps(args, ensure_ascii=False)))
        return calls or None

    def structural_tag(self, functions: list[dict], required: bool, parallel: bool) -> dict:
        """Either form, so each model writes its own: `[TOOL_CALLS]NAME[ARGS]{...}` per call
        (v11+) or `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]` (v2-v7; a model without
        [ARGS] in its vocabulary would have to spell the v11 form out of ordinary tokens).
        required: calls only (one unless `parallel`); auto: free text, and a [TOOL_CALLS] the
        model writes starts well-formed calls."""
        v11 = [
            {
                "type": "tag",
                "begin": f"{BOT}{f['name']}{ARGS}",
                "content": {"type": "json_schema", "json_schema": object_schema(f)},
                "end": "",
            }
            for f in functions
        ]
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f["name"]},
                        "arguments": object_schema(f),
                        "id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"},  # Mistral's ids
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in functions
            ]
        }
        listed = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        space = {"type": "optional", "content": {"type": "const_string", "value": " "}}  # SentencePiece's, not Tekken's
        legacy_list = {"type": "sequence", "elements": [space, {"type": "json_schema", "json_schema": listed}]}
        legacy = {"type": "tag", "begin": BOT, "content": legacy_list, "end": ""}
        if required:
            one = {"type": "or", "elements": v11}
            calls = {"type": "plus", "content": one} if parallel else one
            return {"type": "structural_tag", "format": {"type": "or", "elements": [calls, legacy]}}
        fmt = {"type": "triggered_tags", "triggers": [BOT], "tags": [*v11, legacy], "stop_after_first": not parallel}
        return {"type": "structural_tag", "format": fmt}


class _Extent:
    """Where a JSON list or object ends, read in pieces (strings and escapes respected). It does
    not validate: json.loads judges the whole text once it has closed."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def scan(self, text: str) -> int:
        """Characters of `text` that belong to the value (all of it until the value closes)."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
        return len(text)
