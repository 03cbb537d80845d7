"""gpt-oss's harmony format, read from the generated text: the reasoning parser `openai` (the
analysis channel is the reasoning) and the message reader the `openai` tool parser shares.

What gpt-oss writes after the prompt's `<|start|>assistant` is a sequence of messages,

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the first header without `<|start|>assistant`, which the prompt already wrote; a recipient may
also come first: ` to=functions.NAME<|channel|>commentary json<|message|>`; the engine usually
drops the final stop token, <|return|> or <|call|>). Each header is parsed by openai-harmony's
own StreamableParser (role, channel, recipient, content type: its rules, not a regex of ours);
the bodies are the text up to <|end|>, <|call|> or <|return|> (harmony treats every other token
there as content too) and stream as they come.

Where the text goes (vLLM's HarmonyParser decides the same): analysis -> reasoning; final, and
commentary with no recipient (a preamble) -> content, messages joined with "\\n"; a message to
a recipient -> a call (the tool parser's); other channels and other roles -> dropped. Text that
is no harmony (the model ignored the format, a header harmony refuses) is content, verbatim.

The chat layer runs the reasoning parser first and the tool parser on what it left as content.
So that a call survives that hand-over, this reasoning parser leaves each message to a
recipient in the content in harmony form (`<|start|>assistant...<|message|>ARGS<|call|>`),
and the tool parser reads both that and a raw output (no reasoning parser): a text that opens
with a header (`<|channel|>` or ` to=`) is a raw output, anything else content in which
messages start with `<|start|>`. Without a tool parser such a call stays visible in the
content (a model calling a function it was not given, or tool_choice "none"), never lost.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from baton.serve.openai.harmony_vocab import harmony_encoding
from baton.serve.openai.reasoning.base import ReasoningDelta, ReasoningParser
from baton.serve.openai.tool_parsers.streaming import held_suffix
from openai_harmony import HarmonyError, Role, StreamableParser, StreamState

START = "<|start|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
STOPS = ("<|end|>", "<|call|>", "<|return|>")  # what ends a message body
RAW_OPENERS = (CHANNEL, " to=")  # how a raw output's first header begins
HEADER_LIMIT = 1024  # a header longer than this without <|message|> is not one
ANALYSIS_OPEN = CHANNEL + "analysis" + MESSAGE


@dataclass(frozen=True)
class Header:
    """A message's header, as openai-harmony parsed it, and its text as written."""

    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str  # from <|start|> (or the output's start) through <|message|>

    @property
    def kind(self) -> str:
        """Where the message goes: "call", "reasoning", "content" or "other" (dropped)."""
        if self.role != "assistant":
            return "other"
        if self.recipient:
            return "call"
        if self.channel == "analysis":
            return "reasoning"
        return "content" if self.channel in ("final", "commentary") else "other"

    def as_message_start(self) -> str:
        """The header as a later message's: with its `<|start|>assistant` (a raw output's first
        header has none: the prompt wrote it)."""
        return self.text if self.text.startswith(START) else START + "assistant" + self.text


@dataclass
class Event:
    """What the reader found: "open" (a header; `header` set), "body" (message text), "close"
    (the stop marker's text; "" at the end of output), "stray" (text outside any message)."""

    what: str
    text: str = ""
    header: Header | None = None


class HarmonyReader:
    """Harmony text in, Events out, fed in pieces; the events do not depend on where the text
    was cut (a marker cut in two is held until it is whole)."""

    def __init__(self, in_analysis: bool = False):
        harmony_encoding()  # load the vocabulary now, not at the first header
        self._buf = ""
        # "?": the first characters decide; "expect": between messages; "header"; "body"
        self._where = "?"
        self._raw_header = False  # the header being read is a raw output's first (role implied)
        if in_analysis:  # the prompt opened an analysis message: the output starts in its body
            self._where = "body"

    @staticmethod
    def starts_in_analysis(prompt_text: str) -> bool:
        """Whether a prompt leaves an analysis message open (generation continues its body)."""
        last = prompt_text[prompt_text.rfind(START) + len(START) :] if START in prompt_text else prompt_text
        at = last.rfind(MESSAGE)
        return at >= 0 and ANALYSIS_OPEN in last[: at + len(MESSAGE)] and not any(s in last[at:] for s in STOPS)

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events, final):
            pass
        if final and self._where == "body":
            events.append(Event("close"))
            self._where = "expect"
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        buf = self._buf
        if self._where == "?":
            if not final and any(o.startswith(buf) and o != buf for o in RAW_OPENERS):
                return False
            raw = buf.startswith(RAW_OPENERS)
            self._where, self._raw_header = ("header" if raw else "expect"), raw
            return True
        if self._where == "expect":
            i = buf.find(START)
            if i < 0:
                keep = 0 if final else held_suffix(buf, (START,))
                self._stray(buf[: len(buf) - keep], events)
                self._buf = buf[len(buf) - keep :]
                return False
            self._stray(buf[:i], events)
            self._buf, self._where, self._raw_header = buf[i:], "header", False
            return True
        if self._where == "header":
            i = buf.find(MESSAGE)
            if i < 0 and len(buf) <= HEADER_LIMIT + len(MESSAGE):
                if final:  # the output was cut inside a header: a message that never began
                    self._buf, self._where = "", "expect"
                return False
            header = read_header(buf[: i + len(MESSAGE)], self._raw_header) if 0 <= i <= HEADER_LIMIT else None
            if header is None:
                # not a header harmony reads: its text is content, read on as text between
                # messages (a <|start|> it began with goes out as is, so it cannot loop)
                lead = START if buf.startswith(START) else ""
                self._stray(lead, events)
                self._buf, self._where = buf[len(lead) :], "expect"
                return True
            events.append(Event("open", header=header))
            self._buf, self._where = buf[i + len(MESSAGE) :], "body"
            return True
        # body
        found = [(j, s) for s in STOPS if (j := buf.find(s)) >= 0]
        if not found:
            keep = 0 if final else held_suffix(buf, STOPS)
            if len(buf) > keep:
                events.append(Event("body", buf[: len(buf) - keep]))
            self._buf = buf[len(buf) - keep :]
            return False
        j, stop = min(found)
        if j:
            events.append(Event("body", buf[:j]))
        events.append(Event("close", stop))
        self._buf, self._where = buf[j + len(stop) :], "expect"
        return True

    def _stray(self, text: str, events: list[Event]) -> None:
        if text:
            events.append(Event("stray", text))


@functools.lru_cache(maxsize=4096)
def read_header(text: str, first: bool) -> Header | None:
    """openai-harmony's reading of one header (text through <|message|>; `first`: a raw
    output's first header, whose role the prompt gave); None if harmony refuses it. Cached: a
    model writes the same few headers over and over, and each read builds a harmony parser."""
    enc = harmony_encoding()
    parser = StreamableParser(enc, Role.ASSISTANT if first else None)
    try:
        for token in _tokens(enc, text):
            parser.process(token)
    except HarmonyError:
        return None
    if parser.state != StreamState.CONTENT:
        return None
    role = parser.current_role
    return Header(
        role=role.value if role is not None else "",
        channel=parser.current_channel,
        recipient=parser.current_recipient,
        content_type=parser.current_content_type,
        text=text,
    )


def _tokens(enc, text: str) -> list[int]:
    """Harmony's tokens for header text: its special markers as themselves (the text is what the
    model generated, markers included), the rest as ordinary text."""
    tokens: list[int] = []
    pos = 0
    while pos < len(text):
        at = text.find("<|", pos)
        end = text.find("|>", at + 2) + 2 if at >= 0 else 1
        special = _special_id(enc, text[at:end]) if end > 1 else None
        if special is None:
            stop = end if end > 1 else len(text)
            tokens += enc.encode(text[pos:stop], disallowed_special=())
            pos = stop
            continue
        tokens += enc.encode(text[pos:at], disallowed_special=()) + [special]
        pos = end
    return tokens


@functools.cache
def _special_id(enc, text: str) -> int | None:
    """A harmony special token's id (None for other text). openai-harmony's own encode checks
    every call against all ~1100 special tokens with a regex it builds anew: far too slow for a
    parser that reads each header."""
    if text not in enc.special_tokens_set:
        return None
    return enc.encode(text, allowed_special={text}, disallowed_special=())[0]


class Parser(ReasoningParser):
    """analysis -> reasoning; final and preambles -> content; messages to a recipient stay in
    the content in harmony form for the tool parser (see the module docstring)."""

    name: ClassVar[str] = "openai"
    end_text: ClassVar[str] = "<|end|>"  # ends the analysis message; a thinking budget forces it

    def __init__(self, starts_in_reasoning: bool = False):
        super().__init__(starts_in_reasoning)
        self._reader = HarmonyReader(in_analysis=starts_in_reasoning)
        self._kind = "reasoning" if starts_in_reasoning else ""
        self._said = {"reasoning": False, "content": False}  # a message of that kind has had text
        self._new = False  # the current message has had no text yet

    @classmethod
    def thinking_at_start(cls, prompt_text: str, output_prefix: str = "") -> bool:
        """Only where the prompt left an analysis message open: a harmony output names its
        channels, so the parser needs no hint, and a grammar must not wait for an <|end|> that
        a model answering straight on the final channel never writes (the tool grammars allow
        the analysis message themselves)."""
        return HarmonyReader.starts_in_analysis(prompt_text + output_prefix)

    def split(self, text: str) -> tuple[str | None, str]:
        fresh = type(self)(self.starts_in_reasoning)
        a, b = fresh.feed(text), fresh.finish()
        return (a.reasoning + b.reasoning) or None, a.content + b.content

    def feed(self, delta: str) -> ReasoningDelta:
        return self._route(self._reader.feed(delta))

    def finish(self) -> ReasoningDelta:
        return self._route(self._reader.feed("", final=True))

    def _route(self, events: list[Event]) -> ReasoningDelta:
        out = ReasoningDelta()
        for ev in events:
            if ev.what == "stray":
                out.content += ev.text
            elif ev.what == "open":
                self._kind, self._new = ev.header.kind, True
                if self._kind == "call":
                    out.content += ev.header.as_message_start()
            elif ev.what == "body" and self._kind in ("reasoning", "content"):
                sep = "\n" if self._new and self._said[self._kind] else ""
                setattr(out, self._kind, getattr(out, self._kind) + sep + ev.text)
                self._said[self._kind], self._new = True, False
            elif ev.what == "body" and self._kind == "call":
                out.content += ev.text
            elif ev.what == "close" and self._kind == "call":
                out.content += ev.text
        return out
