"""Structured outputs: the request-side spec (JSON schema, JSON object, regex or EBNF grammar), and
the matcher a sequence carries (SequenceGrammar).

Kept free of xgrammar at import so the API layers (gRPC, HTTP) can build and validate specs
cheaply; the grammar machinery that compiles and enforces them during sampling lives in
serve/grammar.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr

_KINDS = ("json", "json_object", "regex", "grammar")


@dataclass
class StructuredOutputs:
    """Exactly one of the fields is set. `json` is a JSON schema (a dict or its JSON text)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None  # EBNF (xgrammar's / GBNF dialect), root rule `root`

    def set_kinds(self) -> list[str]:
        return [
            k for k in _KINDS if (self.json_object is not False if k == "json_object" else getattr(self, k) is not None)
        ]

    @property
    def kind(self) -> str:
        return self.set_kinds()[0]

    def validate(self) -> None:
        """Raise ValueError naming the problem. Syntax of the schema/regex/grammar itself is checked
        by compiling it at admission (serve/grammar.py), since only the library knows its dialect."""
        kinds = self.set_kinds()
        if len(kinds) != 1:
            raise ValueError(
                f"structured outputs need exactly one of json, json_object, regex, grammar; got {kinds or 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured.json must be a JSON schema object, got {type(schema).__name__}")
        if self.json_object not in (False, True):
            raise ValueError(f"structured.json_object must be true or false, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured.{name} must be a non-empty string, got {value!r}")

    def key(self) -> tuple[str, str]:
        """A hashable identity for the compiled-grammar cache (dict schemas canonicalised)."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return kind, text
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


class SequenceGrammar:
    """One sequence's matcher: where it stands in the grammar after the tokens it has output."""

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher

    def fork(self) -> SequenceGrammar:
        return SequenceGrammar(self.matcher.fork())

    def accept(self, token: int) -> None:
        """Advance past a sampled token; the mask made any other outcome impossible, so a refusal
        is a bug that fails this request only."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()
