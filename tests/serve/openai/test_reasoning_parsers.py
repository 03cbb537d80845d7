"""The qwen3 and deepseek_r1 reasoning parsers (<think>...</think>).

References: vLLM's own qwen3 / deepseek_r1 parsers on the same texts (data/vllm_reasoning_cases_*.json,
recorded by benchmarks/vllm_parser_reference.py from data/reasoning_cases_*.json, each with the
prompt that decides whether generation starts inside thinking), and the families' real chat
templates for thinking_at_start. Streaming is checked against the unary split with the text cut
at every character boundary and fed a character at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from baton.serve.openai.chat import ChatTemplate
from baton.serve.openai.reasoning import reasoning_parser_class
from baton.serve.openai.reasoning.base import ReasoningDelta

from .agent_fixtures import (
    family_ckpts,  # noqa: F401 - a fixture these tests use
    tool_conversation,
)

DATA = Path(__file__).parent / "data"
PARSERS = ("qwen3", "deepseek_r1")
# Cases where vLLM's paths disagree with each other; there the parser follows vLLM's token-by-token
# stream, the path a streaming server must take and can keep in step with its unary answer:
# - qwen3: its unary parse drops a second </think> in the answer, its streams keep it;
# - deepseek_r1: its unary parse ignores the prompt (prompt_closed), drops text before the first
#   <think> and keeps a later one (lead_whitespace, reopened); its 4-token stream leaks <think>
#   into the reasoning wherever the marker shares a delta with text.
VLLM_SELF_DISAGREES = {
    "qwen3": {"second_close", "open_in_answer"},
    "deepseek_r1": {
        "plain",
        "unclosed",
        "unicode",
        "near_markers",
        "second_close",
        "open_in_answer",
        "reopened",
        "lead_whitespace",
        "prompt_closed",
    },
}


def cases(name: str) -> list[tuple[dict, dict]]:
    ours = json.loads((DATA / f"reasoning_cases_{name}.json").read_text())
    vllm = {r["id"]: r for r in json.loads((DATA / f"vllm_reasoning_cases_{name}.json").read_text())}
    assert set(vllm) == {c["id"] for c in ours}, "re-run benchmarks/vllm_parser_reference.py on the case file"
    return [(c, vllm[c["id"]]) for c in ours]


def parser_for(case: dict):
    cls = reasoning_parser_class(case["reasoning_parser"])
    return cls(cls.thinking_at_start(case.get("prompt", "")))


def plain(reasoning, content) -> tuple[str, str]:
    """vLLM says None for an empty part; we say None for no reasoning and "" for no content."""
    return reasoning or "", content or ""


@pytest.mark.parametrize("name", PARSERS)
def test_split_equals_vllms_parser(name):
    disagree = set()
    for case, ref in cases(name):
        got = plain(*parser_for(case).split(case["text"]))
        unary = plain(ref["unary"].get("reasoning"), ref["unary"].get("content"))
        if ref["streamed_equals_unary"]:
            assert got == unary, case["id"]
        else:
            disagree.add(case["id"].removeprefix(f"{name}-"))
            stream = ref["streamed"]["tokens1"]
            assert got == plain(stream.get("reasoning"), stream.get("content")), case["id"]
    assert disagree == VLLM_SELF_DISAGREES[name]


def streamed(parser, pieces) -> tuple[str, str]:
    out = ReasoningDelta()
    for piece in pieces:
        d = parser.feed(piece)
        out.reasoning, out.content = out.reasoning + d.reasoning, out.content + d.content
    d = parser.finish()
    return out.reasoning + d.reasoning, out.content + d.content


@pytest.mark.parametrize("name", PARSERS)
def test_streaming_equals_split_at_every_cut(name):
    for case, _ in cases(name):
        text = case["text"]
        want = plain(*parser_for(case).split(text))
        assert streamed(parser_for(case), list(text)) == want, case["id"]
        for cut in range(len(text) + 1):
            assert streamed(parser_for(case), [text[:cut], text[cut:]]) == want, (case["id"], cut)


def test_nothing_is_sent_early_or_held_long():
    """A marker's first characters wait for the rest; anything else goes out at once."""
    p = reasoning_parser_class("qwen3")(True)
    assert p.feed("I think </th") == ReasoningDelta(reasoning="I think ")
    assert p.feed("ink>\n\nHi <") == ReasoningDelta(content="\n\nHi <")  # answer text: no markers
    p = reasoning_parser_class("qwen3")(True)
    assert p.feed("a <tool_") == ReasoningDelta(reasoning="a ")
    assert p.feed("call>{") == ReasoningDelta(content="<tool_call>{")
    p = reasoning_parser_class("deepseek_r1")(True)
    assert p.feed("a <tool_call>b</thin") == ReasoningDelta(reasoning="a <tool_call>b")
    assert p.finish() == ReasoningDelta(reasoning="</thin")


def test_thinking_off_is_all_answer():
    for name in PARSERS:
        p = reasoning_parser_class(name)(False)
        assert p.split("<think>x</think>y") == (None, "<think>x</think>y")
        assert streamed(p, ["<think>x", "</think>y"]) == ("", "<think>x</think>y")


def test_thinking_at_start_from_the_families_templates(family_ckpts):  # noqa: F811
    """Read from prompts the real templates render: Qwen3 leaves the prompt plain when thinking
    is on (the model opens <think>) and closes an empty block when enable_thinking is false;
    DeepSeek-R1's opens <think>\\n; DeepSeek-V3.1's opens <think> or closes with </think> by its
    `thinking` kwarg. A closed block of an earlier turn decides nothing."""
    hi = [{"role": "user", "content": "Hi"}]
    qwen = ChatTemplate(family_ckpts["qwen3"])
    r1 = ChatTemplate(family_ckpts["deepseek_r1"])
    v31 = ChatTemplate(family_ckpts["deepseek_v31"])
    history = tool_conversation()
    history[2]["reasoning_content"] = "Paris, then."
    prompts = {
        "qwen3 thinking": (qwen.render(hi), True),
        "qwen3 enable_thinking false": (qwen.render(hi, template_kwargs={"enable_thinking": False}), False),
        "qwen3 after a turn that thought": (qwen.render(history), True),
        "deepseek_r1": (r1.render(hi), True),
        "deepseek_v31 thinking": (v31.render(hi, template_kwargs={"thinking": True}), True),
        "deepseek_v31 not thinking": (v31.render(hi), False),
    }
    assert "<think>\nParis, then.\n</think>" in prompts["qwen3 after a turn that thought"][0]
    for name in PARSERS:
        cls = reasoning_parser_class(name)
        for what, (prompt, expected) in prompts.items():
            assert cls.thinking_at_start(prompt) is expected, (name, what, prompt[-40:])
        # an assistant prefix the client wrote continues the prompt
        assert cls.thinking_at_start(qwen.render(hi), "<think>\nabc\n</think>\n\n") is False


def test_registry_and_end_marker():
    for name in PARSERS:
        cls = reasoning_parser_class(name)
        assert cls.name == name and cls.end_text == "</think>"
