"""What every tool parser's tests check the same way: a unary parse, and the same text streamed in
pieces (each call's id and name once, first; argument fragments concatenating to the unary ones)."""

from __future__ import annotations

import json
import random

from baton.serve.openai.tool_parsers import tool_parser_class


def unary(name: str, case: dict) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of the whole text; call ids unique and in the family's form."""
    parsed = tool_parser_class(name)(case["tools"]).parse(case["text"])
    ids = [c.id for c in parsed.tool_calls]
    assert len(set(ids)) == len(ids)
    for i in ids:  # Mistral's templates accept only their own id form
        assert (len(i) == 9 and i.isalnum()) if name == "mistral" else i.startswith("call_")
    return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def streamed(name: str, tools: list[dict], text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """The text fed in pieces cut at `cuts`; each call's id and name must come once, first."""
    parser = tool_parser_class(name)(tools)
    bounds = [0, *cuts, len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    content, calls = "", []
    for d in deltas:
        content += d.content
        for piece in d.tool_calls:
            if piece.id is not None:
                assert piece.index == len(calls) and piece.name
                calls.append([piece.name, ""])
            else:
                assert piece.name is None and piece.index == len(calls) - 1
            calls[piece.index][1] += piece.arguments
    return content, [tuple(c) for c in calls]


def check_streaming(name: str, case: dict, random_chunkings: int) -> None:
    """Streamed equals unary with the text cut at every boundary, a character at a time, and in
    `random_chunkings` random chunkings (seeded by the case id)."""
    text, tools = case["text"], case["tools"]
    want = unary(name, case)
    for i in range(len(text) + 1):
        assert streamed(name, tools, text, [i]) == want, f"cut at {i}: {text[:i]!r} | {text[i:]!r}"
    assert streamed(name, tools, text, list(range(1, len(text)))) == want  # a character at a time
    rng = random.Random(case["id"])
    for _ in range(random_chunkings):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        assert streamed(name, tools, text, cuts) == want, cuts


def check_expected(name: str, case: dict) -> None:
    """The unary parse gives the case's hand-written content and calls (arguments as json.dumps
    writes the expected object)."""
    content, calls = unary(name, case)
    expected = case["expected"]
    assert content == expected["content"]
    assert calls == [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in expected["calls"]]
