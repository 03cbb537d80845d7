"""Structured outputs: the request-side spec (JSON schema, JSON object, regex, EBNF grammar or xgrammar
structural tag), and the constraint a sequence carries (SequenceGrammar: an optional thinking phase,
then the spec's matcher).

Kept free of xgrammar at import so the API layers (gRPC, HTTP) can build and validate specs
cheaply; the grammar machinery that compiles and enforces them during sampling lives in
serve/grammar.py.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr

_KINDS = ("json", "json_object", "regex", "grammar", "structural_tag")
# Objects and arrays nested deeper than this are refused before xgrammar sees them: conversion cost
# grows steeply with depth (vLLM's limits: 64 for a schema, 16 more for a structural tag's wrapping)
MAX_JSON_NESTING = 64
MAX_TAG_NESTING = MAX_JSON_NESTING + 16


def _too_deep(doc, limit: int) -> bool:
    """Whether a JSON document nests objects/arrays more than `limit` levels (breadth-first: no recursion)."""
    level = [doc]
    for _ in range(limit):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def _json_doc(value: str | dict, field: str, limit: int):
    """The parsed document of a field that takes a JSON value or its text; ValueError naming the field."""
    deep = ValueError(f"structured.{field} nests objects and arrays more than {limit} levels deep")
    try:
        doc = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise ValueError(f"structured.{field} is not valid JSON: {e}") from None
    except RecursionError:  # the decoder's own depth limit, far past ours
        raise deep from None
    if isinstance(doc, (dict, list)) and _too_deep(doc, limit):
        raise deep
    return doc


@dataclass
class StructuredOutputs:
    """Exactly one of the fields is set. `json` is a JSON schema (a dict or its JSON text);
    `structural_tag` is an xgrammar structural tag, {"type": "structural_tag", "format": {...}} (or
    vLLM's legacy {"type": "structural_tag", "structures": [...], "triggers": [...]}), a dict or its
    JSON text."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None  # EBNF (xgrammar's / GBNF dialect), root rule `root`
    structural_tag: str | dict | None = None

    def set_kinds(self) -> list[str]:
        return [
            k for k in _KINDS if (self.json_object is not False if k == "json_object" else getattr(self, k) is not None)
        ]

    @property
    def kind(self) -> str:
        return self.set_kinds()[0]

    def validate(self) -> None:
        """Raise ValueError naming the problem. Syntax of the schema/regex/grammar/tag itself is
        checked by compiling it at admission (serve/grammar.py), since only the library knows its dialect."""
        kinds = self.set_kinds()
        if len(kinds) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, json_object, regex, grammar, structural_tag; "
                f"got {kinds or 'none'}"
            )
        if self.json is not None:
            schema = _json_doc(self.json, "json", MAX_JSON_NESTING)
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured.json must be a JSON schema object, got {type(schema).__name__}")
        if self.structural_tag is not None:
            tag = _json_doc(self.structural_tag, "structural_tag", MAX_TAG_NESTING)
            if not isinstance(tag, dict):
                raise ValueError(f"structured.structural_tag must be a JSON object, got {type(tag).__name__}")
            if tag.get("type", "structural_tag") != "structural_tag":
                raise ValueError(f'structured.structural_tag needs "type": "structural_tag", got {tag["type"]!r}')
        if self.json_object not in (False, True):
            raise ValueError(f"structured.json_object must be true or false, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured.{name} must be a non-empty string, got {value!r}")

    def key(self) -> tuple[str, str]:
        """A hashable identity for the compiled-grammar cache (dict schemas canonicalised; a
        structural tag always, so one tool set sent as text or as a dict is one entry)."""
        return self._key

    @functools.cached_property
    def _key(self) -> tuple[str, str]:
        # once per spec: a request's is looked up at validation and again at admission, and
        # canonicalising a big tool set's JSON costs ~0.4 ms (50 tools); a spec is not changed once sent
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return kind, text
        if kind == "structural_tag":
            tag = json.loads(self.structural_tag) if isinstance(self.structural_tag, str) else self.structural_tag
            return kind, json.dumps(tag, sort_keys=True)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


class SequenceGrammar:
    """What one sequence may output next: first, while it is thinking (SamplingParams.thinking), any
    token - except that past the thinking budget the end marker is forced, token by token - and,
    once the output ends with the end marker, what its structured-output matcher allows (nothing
    more without one). Everything here follows from the tokens accepted, in order, so n > 1
    samples fork it and recompute after preemption (which keeps the tokens and this) agrees."""

    def __init__(
        self,
        matcher: xgr.GrammarMatcher | None,
        end_marker: list[int] | None = None,
        budget: int | None = None,
        in_thinking: bool = False,
    ):
        """`end_marker`, `budget`, `in_thinking`: the request's SamplingParams.thinking (None: no thinking)."""
        self.matcher = matcher
        self.end_marker, self.budget = list(end_marker or []), budget
        self.in_thinking = in_thinking and bool(self.end_marker)
        self.num_thought = 0  # tokens output while thinking, its end marker included
        # the last of them: enough to see the marker complete, and whatever prune_proposals tries
        # on top (accept() trims it, so a long thought costs no memory)
        self.recent: list[int] = []
        self.num_after = 0  # tokens accepted after thinking (the matcher's, when there is one)

    def fork(self) -> SequenceGrammar:
        twin = SequenceGrammar(self.matcher.fork() if self.matcher is not None else None, self.end_marker, self.budget)
        twin.in_thinking, twin.num_thought, twin.recent = self.in_thinking, self.num_thought, list(self.recent)
        twin.num_after = self.num_after
        return twin

    def forced_token(self) -> int | None:
        """The only token allowed next while the thinking budget forces the end marker, else None."""
        if not self.in_thinking or self.budget is None:
            return None
        over = self.num_thought - self.budget
        # still thinking, so the forced tokens have not completed the marker yet: over < len(marker)
        return self.end_marker[over] if over >= 0 else None

    @property
    def matching(self) -> bool:
        """Whether the matcher decides the next token (there is one and thinking is over)."""
        return self.matcher is not None and not self.in_thinking

    @property
    def restricts(self) -> bool:
        """Whether anything is masked for the next token (else a row samples as if unconstrained)."""
        return self.matching or self.forced_token() is not None

    def try_accept(self, token: int) -> bool:
        """Advance past `token` if it is allowed next; False (and no change) if not."""
        if self.in_thinking:
            forced = self.forced_token()
            if forced is not None and token != forced:
                return False
            self.recent.append(token)
            self.num_thought += 1
            if self.recent[-len(self.end_marker) :] == self.end_marker:
                self.in_thinking = False  # the grammar applies from the next token on
            return True
        if self.matcher is not None and not self.matcher.accept_token(token):
            return False
        self.num_after += 1
        return True

    def accept(self, token: int) -> None:
        """Advance past a sampled token; the mask made any other outcome impossible, so a refusal
        is a bug that fails this request only."""
        if not self.try_accept(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")
        del self.recent[: max(0, len(self.recent) - len(self.end_marker) + 1)]  # kept: what a marker may start

    def rollback(self, count: int) -> None:
        """Undo the last `count` accepted tokens (speculative proposals tried, then cut)."""
        after = min(count, self.num_after)
        if after and self.matcher is not None:
            self.matcher.rollback(after)
        self.num_after -= after
        if count > after:  # back into thinking (tried tokens only: accept() never trims those)
            del self.recent[len(self.recent) - (count - after) :]
            self.num_thought -= count - after
            self.in_thinking = True

    @property
    def terminated(self) -> bool:
        return self.matching and self.matcher.is_terminated()
