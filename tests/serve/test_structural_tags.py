"""Structural tags (StructuredOutputs.structural_tag, xgrammar's format, as vLLM takes it): hermes-style
tool calls (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`) sampled at temperature 1
over many seeds parse, name a given function and validate against its schema (jsonschema), with and
without speculation; greedy output equals an independent reference (HF transformers' logits masked
by xgrammar's own compile of the same tag); a bad tag is refused naming the problem; the compile
cache counts a hit for a repeated tool set, however its JSON is written."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import transformers
import xgrammar as xgr
from baton.serve.core.sequence import Sequence
from baton.serve.core.structured import StructuredOutputs
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.grammar import mask_logits
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

from .test_structured import _reference, _run

TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
    "add": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    "tag": {
        "type": "object",
        "properties": {"label": {"type": "string", "maxLength": 4}, "on": {"type": "boolean"}},
        "required": ["label"],
    },
    "move": {
        "type": "object",
        "properties": {"steps": {"type": "array", "items": {"enum": ["up", "down"]}, "minItems": 1, "maxItems": 3}},
        "required": ["steps"],
    },
}
PROMPTS = ["The quick brown fox", "def f(x):", "Émigré naïve café"]


def _call(name: str, schema: dict, whitespace: int | None) -> dict:
    content = {"type": "json_schema", "json_schema": schema}
    if whitespace is not None:
        content["max_whitespace_cnt"] = whitespace
    begin = f'<tool_call>\n{{"name": "{name}", "arguments": '
    return {"type": "tag", "begin": begin, "content": content, "end": "}\n</tool_call>"}


def required(tools: dict, whitespace: int | None = 1) -> dict:
    """tool_choice "required" with parallel calls: one call or more, newline-separated, nothing else."""
    tags = [_call(n, s, whitespace) for n, s in tools.items()]
    return {
        "type": "structural_tag",
        "format": {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True},
    }


def named(name: str, whitespace: int | None = None) -> dict:
    """tool_choice naming one function: exactly that call."""
    return {"type": "structural_tag", "format": _call(name, TOOLS[name], whitespace)}


_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)  # argument strings cannot hold a raw newline


def _calls(text: str) -> list[dict]:
    """The hermes calls the text consists of (newline-separated), each validated against its schema."""
    calls, at = [], 0
    while True:
        m = _CALL.match(text, at)
        assert m, text
        call = json.loads(m[1])
        assert set(call) == {"name", "arguments"} and call["name"] in TOOLS, call
        jsonschema.validate(call["arguments"], TOOLS[call["name"]])
        calls.append(call)
        at = m.end()
        if at == len(text):
            return calls
        assert text[at] == "\n", text
        at += 1


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine.from_checkpoint(llama_dir)


def _sample(engine, seeds, n: int = 2) -> tuple[int, set[str]]:
    """Required calls over all tools and a named call, for each seed: every completed output is
    well-formed; returns how many completed and which functions were called."""
    reqs = []
    for s in seeds:
        for kind, tag in (("req", required(TOOLS)), ("named", named(list(TOOLS)[s % len(TOOLS)]))):
            params = SamplingParams(
                n=n, temperature=1.0, seed=1000 * s, max_tokens=160, structured=StructuredOutputs(structural_tag=tag)
            )
            reqs.append((f"{kind}-{s}", PROMPTS[s % len(PROMPTS)], params))
    completed, names = 0, set()
    for rid, outs in _run(engine, reqs).items():
        assert len(outs) == n
        for c in outs:
            if c.finish_reason != "stop":
                continue
            calls = _calls(c.text)
            if rid.startswith("named"):
                assert [call["name"] for call in calls] == [list(TOOLS)[int(rid.split("-")[1]) % len(TOOLS)]]
            names |= {call["name"] for call in calls}
            completed += 1
    return completed, names


def test_sampled_calls_validate(engine):
    """24 seeds x n=2 x (required, named) at temperature 1: the completed outputs (nearly all) are
    calls to given functions whose arguments validate, and every function gets called."""
    completed, names = _sample(engine, range(24))
    assert completed >= 80 and names == set(TOOLS)


def test_sampled_calls_validate_with_speculation_and_preemption(llama_dir):
    sched = SchedulerConfig(max_num_seqs=8, preemption_mode="recompute")
    cfg = EngineConfig(num_kv_blocks=12, scheduler=sched, speculative=SpeculativeConfig("ngram", 4))
    eng = LLMEngine.from_checkpoint(llama_dir, cfg)
    completed, _ = _sample(eng, range(4))
    st = eng.stats()
    assert completed >= 12 and st.spec_accepted_tokens > 0 and st.preemptions > 0


def test_greedy_equals_xgrammars_own_compile(llama_dir, engine):
    """The tool set without free strings (where our string fix changes nothing): Baton's greedy
    output equals HF's argmax under xgrammar's own compile_structural_tag of the same tag."""
    tools = {k: v for k, v in TOOLS.items() if k != "tag"}
    tags = [required(tools), named("get_weather", whitespace=1), named("move", whitespace=1)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir.parent / "hf-llama").eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    reqs, want = [], {}
    for i, tag in enumerate(tags):
        prompt = PROMPTS[i % len(PROMPTS)]
        ids = tok.encode(prompt, add_special_tokens=False)
        want[str(i)] = _reference(hf, info, ids, compiler.compile_structural_tag(json.dumps(tag)), 100)
        so = StructuredOutputs(structural_tag=tag)
        reqs.append((str(i), prompt, SamplingParams(temperature=0, max_tokens=100, structured=so)))
    done = _run(engine, reqs)
    assert {rid: outs[0].token_ids for rid, outs in done.items()} == want
    assert all(done[str(i)][0].finish_reason == "stop" for i in range(len(tags)))


def test_json_strings_in_tags_exclude_what_json_forbids(engine):
    """As for JSON schemas (test_structured): no UTF-16 surrogates (invalid UTF-8) or, under
    maxLength, raw control characters in an argument string, which xgrammar's own grammar admits."""
    surrogate, control = "\ud834".encode("utf-8", "surrogatepass"), b"\x06"
    for string, stock_admits in [({"type": "string"}, [surrogate]), ({"maxLength": 8}, [surrogate, control])]:
        schema = {"type": "object", "properties": {"x": {"type": "string", **string}}, "required": ["x"]}
        tag = json.dumps(required({"s": schema}))
        ours = engine.grammars.compile(StructuredOutputs(structural_tag=tag))
        stock = engine.grammars._get_compiler().compile_structural_tag(tag)
        start = b'<tool_call>\n{"name": "s", "arguments": {"x": "'
        for text in (surrogate, control, "é🦊a".encode()):
            m, s = xgr.GrammarMatcher(ours), xgr.GrammarMatcher(stock)
            assert m.accept_string(start) and s.accept_string(start)
            assert m.accept_string(text) is (text not in (surrogate, control)), text
            assert s.accept_string(text) is (text not in (surrogate, control) or text in stock_admits), text


def test_vllm_legacy_form_is_taken(engine):
    """vLLM's {"structures": [{"begin", "schema", "end"}], "triggers"}: free text, and a call after a trigger."""
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<f=add>", "schema": TOOLS["add"], "end": "</f>"}],
        "triggers": ["<f="],
    }
    m = xgr.GrammarMatcher(engine.grammars.compile(StructuredOutputs(structural_tag=json.dumps(legacy))))
    assert m.accept_string("hi <f=add>") and not m.accept_string('{"c"')
    assert m.accept_string('{"a": 1, "b": 2}</f> bye')


def test_cache_counts_a_hit_for_a_repeated_tool_set(engine):
    """One miss for the first request with a tool set (compiled at validation, as servers do),
    then hits, whether the tag comes as a dict or as JSON text with its keys in another order."""
    tag = named("add", whitespace=2)  # a tool set no other test uses
    before = engine.grammars.stats()
    first = SamplingParams(max_tokens=4, structured=StructuredOutputs(structural_tag=tag))
    engine.validate_request("hello", first)
    reordered = json.dumps(dict(reversed(list(tag.items()))))
    assert reordered != json.dumps(tag)
    reqs = [("a", "hello", first), ("b", "hello", SamplingParams(max_tokens=4, structured=first.structured))]
    reqs.append(("c", "hello", SamplingParams(max_tokens=4, structured=StructuredOutputs(structural_tag=reordered))))
    _run(engine, reqs)
    after = engine.grammars.stats()
    count = lambda s, k: getattr(s, k).get("structural_tag", 0)  # noqa: E731
    assert (count(after, "misses") - count(before, "misses"), count(after, "hits") - count(before, "hits")) == (1, 2)
    assert after.compile_seconds["structural_tag"] > 0


def _deep() -> dict:
    fmt: dict = {"type": "const_string", "value": "x"}
    for _ in range(50):
        fmt = {"type": "sequence", "elements": [fmt]}
    return {"type": "structural_tag", "format": fmt}


@pytest.mark.parametrize(
    "tag, names",
    [
        ({"type": "structural_tag", "format": {"type": "nope"}}, "structural tag is not supported or invalid.*nope"),
        (
            {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": "frobnicate"}}},
            "structural tag is not supported or invalid",
        ),
        ({"type": "structural_tag", "format": {"type": "tag", "content": {"type": "any_text"}}}, "structural tag"),
        ({"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a"]}, r"structures\[0\]: schema"),
        ({"type": "json_schema", "format": {"type": "any_text"}}, 'structural_tag needs "type": "structural_tag"'),
        ("{not json", "structured.structural_tag is not valid JSON"),
        ([1], "structured.structural_tag must be a JSON object"),
        ("null", "structured.structural_tag must be a JSON object"),
        (_deep(), "structured.structural_tag nests objects and arrays more than 80 levels"),
    ],
)
def test_bad_tag_is_refused_naming_it(engine, tag, names):
    with pytest.raises(ValueError, match=names):
        engine.add_request("bad", "hello", SamplingParams(structured=StructuredOutputs(structural_tag=tag)))
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, grammar, structural_tag"):
        StructuredOutputs(regex="a", structural_tag=named("add")).validate()
    assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
    so = StructuredOutputs(structural_tag=named("add", whitespace=1))
    done = _run(engine, [("after", "hello", SamplingParams(temperature=0, max_tokens=100, structured=so))])
    assert [c["name"] for c in _calls(done["after"][0].text)] == ["add"]  # the engine goes on serving


def test_logits_outside_the_tag_are_masked(engine):
    """The first token of a named call can only start its begin string (a sanity check of the mask)."""
    seq = Sequence(0, "r", 0, [1], SamplingParams())
    seq.grammar = engine.grammars.matcher(StructuredOutputs(structural_tag=named("add")))
    logits = torch.zeros(1, engine.vocab_size)
    mask_logits(logits, [seq])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and all("<tool_call>".startswith(engine.tokenizer.decode([t])) for t in allowed)
