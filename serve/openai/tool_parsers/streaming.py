"""Shared machinery for tool-call parsers that read the output as it streams.

- `JsonStream`: one JSON value read piece by piece and written back in `json.dumps(value,
  ensure_ascii=False)` form (", " and ": " separators, non-ASCII as is) as far as it is certain,
  so a call's argument fragments concatenate to its unary arguments whatever the cuts are.
- `Framing`: the content around calls, without the whitespace the chat template puts next to a
  call (Qwen renders `content + "\\n<tool_call>..."`): that whitespace is framing, not content.
- `IncrementalToolParser`: a `ToolParser` whose `parse` is its own `feed` + `finish` on the whole
  text, so unary and streamed results agree by construction; a subclass writes `_step` only.
- `held_suffix`: how much of a buffer's end could still grow into a marker (held back);
  `match_head`: a call's head (a `regex` pattern, matched partially while it may still grow).

Why not partial-json-parser for the arguments: its completion of a prefix is not a validator
(`{"a": 1,}`, `"\\q"` and raw control characters pass; a complete number before a space is
dropped), so an argument stream built on it can send text that the finished JSON contradicts;
and re-parsing the whole prefix on every token is quadratic in the arguments' length. A JSON
scanner that moves forward character by character has neither problem: what it has sent is
always a prefix of the final text, and a break is found at the character that breaks it.
"""

from __future__ import annotations

import math
import re
from abc import abstractmethod
from json.decoder import scanstring
from json.encoder import encode_basestring

import regex
from baton.serve.openai.tool_parsers.base import (
    ParsedMessage,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    call_id,
)

_WS = " \t\n\r"  # JSON's whitespace
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # a run of string characters that need no decoding
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = ("true", "false", "null")
_SURROGATE = re.compile("[\ud800-\udfff]")


HEAD_LIMIT = 256  # a call's head (marker, name, ...) longer than this is not one: names are <= 64 characters


def match_head(pattern: regex.Pattern, text: str, final: bool, pos: int = 0) -> tuple[bool, regex.Match | None]:
    """`pattern` (a call's head) at text[pos:]: (True, None) while more text may still complete
    it, else (False, the match or None). A head ending past HEAD_LIMIT characters is no head, in
    unary and streaming alike (so a model that never closes one does not make us wait forever)."""
    m = pattern.match(text, pos, partial=True)
    if m is not None and m.partial:
        return (not final and len(text) - pos <= HEAD_LIMIT), None
    return False, (m if m is not None and m.end() - pos <= HEAD_LIMIT else None)


def held_suffix(text: str, markers: tuple[str, ...] | list[str]) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of `markers`
    (text that must wait: the next piece may complete the marker)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def object_schema(function: dict) -> dict:
    """A function's parameters as the JSON schema of an object (a structural tag's arguments
    content: the parsers take arguments that are an object only)."""
    schema = dict(function.get("parameters") or {})
    schema.setdefault("type", "object")
    return schema


def dump_string(s: str) -> str:
    """A JSON string literal in json.dumps(ensure_ascii=False) form (its string encoder), with any
    lone surrogate escaped (raw, it could not be encoded as UTF-8 on the wire)."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", encode_basestring(s))


def canonical_number(token: str) -> str:
    """A JSON number as json.dumps writes the value json.loads reads (1.50 -> 1.5, 1E3 -> 1000.0);
    one that overflows a float stays as written (json.dumps would write the invalid Infinity)."""
    if not any(c in token for c in ".eE"):
        return str(int(token))
    value = float(token)
    return repr(value) if math.isfinite(value) else token


class JsonStream:
    """One JSON value, fed in pieces; `feed` returns the canonical text that became certain.

    Canonical: json.dumps(json.loads(text), ensure_ascii=False), except that repeated object keys
    are kept as written (json.loads would keep the last) and a number beyond a float's range stays
    as written. Raw control characters inside strings are accepted (json.loads(strict=False)) and
    written escaped. Text is held back only inside a token (a number, a literal, an escape, a key
    before its value starts), so a truncated value can be `close`d into valid JSON: an unfinished
    string is closed, an unfinished number, literal or key is dropped, open containers are closed.
    """

    def __init__(self) -> None:
        self.done = False  # the value is complete
        self.failed = False  # the text stopped being JSON (at the character `feed` did not consume)
        self.started = False  # some of the value has been written
        self._stack: list[str] = []  # open containers, "{" or "["
        # what comes next: value | value_or_close | key | key_or_close | colon | after (a value, in a
        # container) | string | key_string | number | literal (inside one)
        self._expect = "value"
        self._pending = ""  # separator and key, written with the first character of the next value
        self._token = ""  # an unfinished number, literal or escape sequence
        self._key: list[str] = []  # the decoded characters of the key being read
        self._high = ""  # a \uD800-\uDBFF escape waiting for its low half

    def feed(self, text: str) -> tuple[str, int]:
        """(canonical text now certain, characters of `text` consumed). It consumes all of `text`
        unless the value ends (done) or breaks (failed) inside it."""
        out: list[str] = []
        i, n = 0, len(text)
        while i < n and not (self.done or self.failed):
            i = self._consume(text, i, out)
        return "".join(out), i

    def close(self) -> str:
        """The text that ends a value the output left unfinished (or broke): "" once done."""
        if self.done:
            return ""
        self.done = True
        if not self.started:
            return ""
        out = ""
        if self._expect == "string":
            out += self._flush_high() + '"'
        return out + "".join("}" if c == "{" else "]" for c in reversed(self._stack))

    # ----------------------------------------------------------------------------- internals
    def _write(self, out: list[str], text: str) -> None:
        out.append(self._pending + text)
        self._pending = ""
        self.started = True

    def _value_done(self) -> None:
        self._expect = "after"
        if not self._stack:
            self.done = True

    def _flush_high(self) -> str:
        high, self._high = self._high, ""
        return dump_string(high)[1:-1] if high else ""

    def _consume(self, text: str, i: int, out: list[str]) -> int:
        """Reads from text[i]; returns the next index (i itself only when done or failed)."""
        e = self._expect
        c = text[i]
        if e in ("string", "key_string"):
            return self._string(text, i, out)
        if e == "number":
            if c in _NUMBER_CHARS:
                self._token += c
                return i + 1
            if not _NUMBER.fullmatch(self._token):
                self.failed = True
                return i
            self._write(out, canonical_number(self._token))
            self._token = ""
            self._value_done()
            return i  # the delimiter is read in the "after" state (or left to the caller)
        if e == "literal":
            word = self._token + c
            if not any(lit.startswith(word) for lit in _LITERALS):
                self.failed = True
                return i
            self._token = word
            if word in _LITERALS:
                self._write(out, word)
                self._token = ""
                self._value_done()
            return i + 1
        if c in _WS:
            return i + 1
        if e in ("value", "value_or_close"):
            if c == "]" and e == "value_or_close":
                return self._close_container(c, out, i)
            if c in "{[":
                self._write(out, c)
                self._stack.append(c)
                self._expect = "key_or_close" if c == "{" else "value_or_close"
            elif c == '"':
                self._write(out, '"')
                self._expect = "string"
            elif c == "-" or c.isdigit():
                self._token, self._expect = c, "number"
            elif c in "tfn":
                self._token, self._expect = c, "literal"
            else:
                self.failed = True
                return i
            return i + 1
        if e in ("key", "key_or_close"):
            if c == "}" and e == "key_or_close":
                return self._close_container(c, out, i)
            if c != '"':
                self.failed = True
                return i
            self._expect = "key_string"
            return i + 1
        if e == "colon":
            if c != ":":
                self.failed = True
                return i
            self._expect = "value"
            return i + 1
        # after a value inside a container
        top = self._stack[-1]
        if c == ",":
            self._pending = ", "
            self._expect = "key" if top == "{" else "value"
            return i + 1
        if (c == "}" and top == "{") or (c == "]" and top == "["):
            return self._close_container(c, out, i)
        self.failed = True
        return i

    def _close_container(self, c: str, out: list[str], i: int) -> int:
        self._stack.pop()
        self._pending = ""
        self._write(out, c)
        self._value_done()
        return i + 1

    def _string(self, text: str, i: int, out: list[str]) -> int:
        key = self._expect == "key_string"
        if self._token:  # inside an escape sequence
            self._token += text[i]
            decoded = self._escape()
            if decoded is None:
                return i + 1 if not self.failed else i
            self._token = ""
            self._string_char(decoded, key, out)
            return i + 1
        if not self._high and text.find('"', i) >= 0:  # the string may end here: json's C scanner reads it at once
            try:
                decoded, end = scanstring(text, i, False)
            except ValueError:
                pass
            else:
                if decoded:
                    self._string_text(decoded, key, out)
                self._string_closed(key, out)
                return end
        m = _PLAIN.match(text, i)
        if m:
            self._string_text(m.group(), key, out)
            return m.end()
        c = text[i]
        if c == "\\":
            self._token = c
        elif c == '"':
            self._string_closed(key, out)
        else:  # a raw control character: json.loads(strict=False) takes it
            self._string_text(c, key, out)
        return i + 1

    def _string_closed(self, key: bool, out: list[str]) -> None:
        if key:
            self._key_done()
        else:
            self._write(out, self._flush_high() + '"')
            self._value_done()

    def _escape(self) -> str | None:
        """The character of the escape in self._token once complete, None while unfinished or bad."""
        t = self._token
        if len(t) == 2 and t[1] != "u":
            if t[1] not in _SIMPLE_ESCAPES:
                self.failed = True
                return None
            return _SIMPLE_ESCAPES[t[1]]
        if len(t) > 2 and not all(h in "0123456789abcdefABCDEF" for h in t[2:]):
            self.failed = True
            return None
        return chr(int(t[2:], 16)) if len(t) == 6 else None

    def _string_char(self, ch: str, key: bool, out: list[str]) -> None:
        """A decoded escape: a high surrogate waits for its low half (json.loads joins the pair)."""
        if self._high and "\udc00" <= ch <= "\udfff":
            pair = (ord(self._high) - 0xD800) * 0x400 + (ord(ch) - 0xDC00) + 0x10000
            self._high = ""
            self._string_text(chr(pair), key, out)
        elif "\ud800" <= ch <= "\udbff":
            prior, self._high = self._flush_high(), ch
            if prior:
                self._emit_string(prior, key, out)
        else:
            self._string_text(ch, key, out)

    def _string_text(self, s: str, key: bool, out: list[str]) -> None:
        self._emit_string(self._flush_high() + dump_string(s)[1:-1], key, out)

    def _emit_string(self, escaped: str, key: bool, out: list[str]) -> None:
        if key:
            self._key.append(escaped)
        else:
            self._write(out, escaped)

    def _key_done(self) -> None:
        self._pending += '"' + "".join(self._key) + self._flush_high() + '": '
        self._key = []
        self._expect = "colon"


class Framing:
    """The content around calls. Whitespace next to a call is the template's framing, not content:
    text before a call loses its trailing whitespace, text after one its leading whitespace, and
    text on both sides of calls is joined by one newline. Output without calls is content as is.
    Streaming holds back a whitespace run until the next text shows whether a call follows."""

    def __init__(self) -> None:
        self.after_call = False  # the current segment follows a call
        self.started = False  # the current segment has shown non-whitespace
        self.wrote = False  # some content went out
        self.pending = ""  # whitespace not yet known to be content

    def text(self, s: str) -> str:
        body = s.rstrip()
        if not body:
            self.pending += s
            return ""
        self.pending, lead = s[len(body) :], self.pending
        if self.after_call and not self.started:  # the segment's leading whitespace is framing
            body, lead = body.lstrip(), "\n" if self.wrote else ""
        self.started = self.wrote = True
        return lead + body

    def call(self) -> None:
        self.pending = ""
        self.after_call, self.started = True, False

    def finish(self) -> str:
        out = self.pending if (self.started or not self.after_call) else ""
        self.pending = ""
        return out


class IncrementalToolParser(ToolParser):
    """A parser written once, as a streaming state machine over a text buffer: `_step` consumes
    from `self._buf` and reports pieces through `_content`, `_begin_call` and `_arguments`.
    `parse` runs the same machine over the whole text, so unary and streamed results are equal
    by construction, and each call's id and name go out once, in its first delta."""

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._buf = ""  # received, not yet consumed
        self._framing = Framing()
        self._out = StreamDelta()
        self._index = -1  # the current call's index
        self._json: JsonStream | None = None  # the current call's arguments, where they are JSON

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Consume what can be consumed from self._buf (final: no more text will come); True to
        be called again (the state changed), False when it must wait for more text."""

    def feed(self, delta: str) -> StreamDelta:
        self._buf += delta
        while self._step(False):
            pass
        return self._take()

    def finish(self) -> StreamDelta:
        while self._step(True):
            pass
        self._out.content += self._framing.finish()
        return self._take()

    def parse(self, text: str) -> ParsedMessage:
        fresh = type(self)(self.tools)
        deltas = [fresh.feed(text), fresh.finish()]
        calls: list[ToolCall] = []
        for d in deltas:
            for piece in d.tool_calls:
                if piece.id is not None:
                    calls.append(ToolCall(name=piece.name or "", arguments="", id=piece.id))
                calls[piece.index].arguments += piece.arguments
        return ParsedMessage(content="".join(d.content for d in deltas), tool_calls=calls)

    def _content_until(self, marker: str, final: bool) -> bool:
        """Content up to `marker`: True with the text before it sent and the marker consumed; False
        with what cannot start one sent and the rest (a possible marker's beginning) held back."""
        buf = self._buf
        at = buf.find(marker)
        if at < 0:
            keep = 0 if final else held_suffix(buf, (marker,))
            self._content(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        self._content(buf[:at])
        self._buf = buf[at + len(marker) :]
        return True

    def known(self, name: str) -> bool:
        """A name the request's tools declare (any name when the request declared none)."""
        return not self.schemas or name in self.schemas

    # ----------------------------------------------------------------------- for subclasses
    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out

    def _content(self, text: str) -> None:
        if text:
            self._out.content += self._framing.text(text)

    def _begin_call(self, name: str) -> None:
        self._framing.call()
        self._index += 1
        self._out.tool_calls.append(ToolCallDelta(index=self._index, id=call_id(), name=name))

    def _begin_json_call(self, name: str, head_end: int) -> None:
        """A call whose arguments are the JSON object opened by the "{" just before
        self._buf[head_end] (the head's last character)."""
        self._begin_call(name)
        self._json = JsonStream()
        self._arguments(self._json.feed("{")[0])
        self._buf = self._buf[head_end:]

    def _json_arguments(self, final: bool) -> bool:
        """Stream the current call's JSON arguments from self._buf; True once they ended (complete,
        broken or cut off by the end of the output), closed into valid JSON."""
        assert self._json is not None
        text, used = self._json.feed(self._buf)
        self._arguments(text)
        self._buf = self._buf[used:]
        if not (self._json.done or self._json.failed or final):
            return False
        self._arguments(self._json.close())
        return True

    def _arguments(self, text: str) -> None:
        if not text:
            return
        calls = self._out.tool_calls
        if calls and calls[-1].index == self._index:
            calls[-1].arguments += text
        else:
            calls.append(ToolCallDelta(index=self._index, arguments=text))
