"""gpt-oss's tool calls (vLLM's `openai` parser): harmony messages addressed to a function,

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

read with the harmony reader of baton.serve.openai.reasoning.harmony (openai-harmony parses each
header). A message to `functions.NAME`, NAME declared, whose body opens a JSON object is a call:
its id and name go out at that "{", and its arguments stream through a JSON scanner
(streaming.JsonStream), coming out as json.dumps writes them (vLLM's unary parse re-serialises
them too); what the body holds after the object is dropped. Such a message to an undeclared
function, or whose body is no object, is content, verbatim in harmony form. Final-channel
messages and preambles (commentary with no recipient) are the content, joined with "\\n" (as
vLLM joins them); analysis is the reasoning parser's and dropped here; messages to other
recipients (built-in tools such as browser.*, which Baton does not offer) are dropped, as vLLM
drops them.

The text is the raw output, or what the `openai` reasoning parser left as content: its final
text with the call messages kept in harmony form (see the reader's docstring).
"""

from __future__ import annotations

from baton.serve.openai.reasoning.harmony import STOPS, Event, HarmonyReader
from baton.serve.openai.tool_parsers.hermes import object_schema
from baton.serve.openai.tool_parsers.streaming import IncrementalToolParser, JsonStream

FUNCTIONS = "functions."
PREFIX = "<|start|>assistant"  # what opens every message after the first
# the headers gpt-oss writes a call with (after <|start|>assistant): channel first, as OpenAI's
# harmony guide shows the model writing it, or recipient first, as openai-harmony renders it;
# the content type with or without <|constrain|>
CALL_HEADERS = (
    "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
    "<|channel|>commentary to=functions.{name} json<|message|>",
    " to=functions.{name}<|channel|>commentary <|constrain|>json<|message|>",
    " to=functions.{name}<|channel|>commentary json<|message|>",
)


class Parser(IncrementalToolParser):
    name = "openai"

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._reader = HarmonyReader()
        # the current message: "call" (arguments streaming), "head" (a function message before
        # its body shows a "{"), "raw" (no call after all: content verbatim), "content", "" (dropped)
        self._kind = ""
        self._pending = ""  # a "head" message's text so far
        self._head_len = 0  # of which its header
        self._name = ""
        self._said = False  # a content message has had text (the next one is joined with "\n")
        self._new = False

    def _step(self, final: bool) -> bool:
        events, self._buf = self._reader.feed(self._buf, final), ""
        for ev in events:
            self._event(ev)
        return False

    def _event(self, ev: Event) -> None:
        if ev.what == "stray":
            self._out.content += ev.text
        elif ev.what == "open":
            h = ev.header
            self._kind, self._new = "", True
            if h.kind == "call" and h.recipient.startswith(FUNCTIONS):
                self._kind, self._name, self._pending = "head", h.recipient[len(FUNCTIONS) :], h.as_message_start()
                self._head_len = len(self._pending)
            elif h.kind == "content":
                self._kind = "content"
        elif ev.what == "body":
            if self._kind == "head":
                self._head(ev.text)
            elif self._kind == "call":
                self._body(ev.text)
            elif self._kind == "raw":
                self._out.content += ev.text
            elif self._kind == "content":
                self._out.content += ("\n" if self._new and self._said else "") + ev.text
                self._said, self._new = True, False
        elif self._kind == "call":  # close
            self._arguments(self._json.close())
        elif self._kind in ("head", "raw"):
            self._out.content += self._pending + ev.text
            self._pending = ""

    def _head(self, text: str) -> None:
        self._pending += text
        body = self._pending[self._head_len :].lstrip()
        if not body:
            return
        if body[0] == "{" and self.known(self._name):
            self._kind = "call"
            self._begin_call(self._name)
            self._json = JsonStream()
            self._body(body)
        else:
            self._kind = "raw"
            self._out.content += self._pending
        self._pending = ""

    def _body(self, text: str) -> None:
        if not (self._json.done or self._json.failed):
            self._arguments(self._json.feed(text)[0])

    def structural_tag(self, functions: list[dict], required: bool, parallel: bool) -> dict:
        """Analysis messages (and, under auto, preambles), then one call (required) or a call
        or a final answer (auto). One call whatever `parallel` says: <|call|> is a stop token,
        so a harmony turn ends at its call. The call and the final answer end with "": their
        stop token (<|call|>, <|return|>) ends the sequence as EOS once the grammar is complete
        (xgrammar cannot match a stop token as text)."""
        text = {"type": "any_text", "excludes": list(STOPS)}  # a stop marker ends a body: none inside one

        def message(channel: str) -> dict:
            body = {"type": "tag", "begin": f"<|channel|>{channel}<|message|>", "content": text, "end": "<|end|>"}
            return {"type": "sequence", "elements": [body, {"type": "const_string", "value": PREFIX}]}

        ends = [
            {
                "type": "tag",
                "begin": header.format(name=f["name"]),
                "content": {"type": "json_schema", "json_schema": object_schema(f), "excludes": list(STOPS)},
                "end": "",
            }
            for f in functions
            for header in CALL_HEADERS
        ]
        before = [message("analysis")]
        if not required:
            ends.append({"type": "tag", "begin": "<|channel|>final<|message|>", "content": text, "end": ""})
            before.append(message("commentary"))
        return {
            "type": "structural_tag",
            "format": {
                "type": "sequence",
                "elements": [
                    {"type": "star", "content": {"type": "or", "elements": before}},
                    {"type": "or", "elements": ends},
                ],
            },
        }
