"""Thinking (SamplingParams.thinking): no grammar while the output is thinking, the structured-output
grammar from the token after the end-of-thinking marker, and a budget that forces the marker at
exactly that output position. Greedy output equals an independent reference (HF transformers'
logits, unmasked while thinking, then masked by xgrammar's own matcher), with and without
speculation; sampled outputs (many seeds, n > 1, a mixed batch, preemption) keep the shape."""

from __future__ import annotations

import json
import random

import grpc
import jsonschema
import pytest
import torch
import transformers
import xgrammar as xgr
from baton.serve.core.sequence import Sequence
from baton.serve.core.structured import SequenceGrammar, StructuredOutputs
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.grammar import json_schema_ebnf, mask_logits, prune_proposals
from baton.serve.request_params import from_json
from baton.serve.rpc import RpcError
from baton.serve.sampling_params import SamplingParams, Thinking
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

from .test_structured import _run

END = "</think>"  # 8 tokens in the test vocabulary: the marker is forced token by token
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "n"],
}
PROMPTS = ["The quick brown fox", "def f(x):", "Émigré naïve café"]


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine.from_checkpoint(llama_dir)


@pytest.fixture(scope="module")
def end(engine):
    ids = engine.tokenizer.encode(END)
    assert len(ids) > 1
    return ids


def _marker_at(ids: list[int], end: list[int]) -> int | None:
    """Where the first complete end marker starts in ids (None: nowhere)."""
    return next((i for i in range(len(ids) - len(end) + 1) if ids[i : i + len(end)] == end), None)


def _json_after(c, end: list[int], at: int) -> None:
    """The output's text after the marker is JSON valid against SCHEMA, and its tokens end with the marker."""
    assert c.finish_reason == "stop", c.text
    thought, _, answer = c.text.partition(END)
    assert _marker_at(c.token_ids, end) == at and END not in thought
    jsonschema.validate(json.loads(answer), SCHEMA)


def test_budget_forces_the_marker_then_the_grammar(engine, end):
    """Temperature 1, 12 seeds, n=2, budgets 0..30: the marker starts at exactly output position
    `budget` (unless the model ended earlier, with EOS), and the rest is JSON valid against SCHEMA."""
    budgets = [0, 5, 17, 30]
    reqs = [
        (
            str(s),
            PROMPTS[s % len(PROMPTS)],
            SamplingParams(
                n=2,
                temperature=1.0,
                seed=100 * s,
                max_tokens=120,
                structured=StructuredOutputs(json=SCHEMA),
                thinking=Thinking(end, budget=budgets[s % len(budgets)]),
            ),
        )  # fmt: skip
        for s in range(12)
    ]
    checked = 0
    for rid, outs in _run(engine, reqs).items():
        budget = budgets[int(rid) % len(budgets)]
        for c in outs:
            if len(c.token_ids) < budget and c.token_ids[-1] == engine.tokenizer.eos_token_id:
                assert _marker_at(c.token_ids, end) is None  # thinking ended the output (no grammar there)
                continue
            _json_after(c, end, budget)
            checked += 1
    assert checked >= 20


def _hf_reference(hf, prompt_ids, end, budget, compiled, max_tokens, eos) -> list[int]:
    """The semantics written out on their own: argmax of HF's logits, unmasked while thinking (the
    marker's tokens forced from position `budget`), then masked by xgrammar's matcher."""
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, hf.config.vocab_size)
    ids, out, thinking = list(prompt_ids), [], True
    while len(out) < max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[:, -1].float()
        if thinking and budget is not None and len(out) >= budget:
            token = end[len(out) - budget]
        elif thinking:
            token = int(logits.argmax())
        else:
            m.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert m.accept_token(token)
        ids.append(token)
        out.append(token)
        if thinking and out[-len(end) :] == end:
            thinking = False
        elif m.is_terminated() or thinking and token == eos:
            break
    return out


@pytest.fixture(scope="module")
def reference(llama_dir, engine, end):
    """Greedy references: (prompt, marker, budget) -> tokens. One marker is "</think>" with a
    budget; the other a single token the model emits by itself early on, with no budget."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir.parent / "hf-llama").eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    eos = tok.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size, stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info).compile_grammar(json_schema_ebnf(SCHEMA))
    free = _run(engine, [("free", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))])
    natural = [free["free"][0].token_ids[3]]  # its first occurrence ends thinking, at position <= 3
    cases = [(PROMPTS[0], end, 6), (PROMPTS[1], natural, None), (PROMPTS[2], end, 0)]
    return [
        (p, e, b, _hf_reference(hf, tok.encode(p, add_special_tokens=False), e, b, compiled, 100, eos))
        for p, e, b in cases
    ]


@pytest.mark.parametrize("speculative", [None, "ngram", "draft"])
def test_greedy_equals_reference(llama_dir, engine, reference, speculative):
    """n=2 greedy thinking requests beside a plain constrained one. With a draft (the target itself)
    the proposal chains run into the forced marker and across the end of thinking, cut there by
    prune_proposals (accept, then roll back into thinking)."""
    spec = {
        "ngram": SpeculativeConfig("ngram", 3),
        "draft": SpeculativeConfig("draft", 3, draft_model=str(llama_dir)),
    }.get(speculative)
    eng = engine if spec is None else LLMEngine.from_checkpoint(llama_dir, EngineConfig(speculative=spec))
    so = StructuredOutputs(json=SCHEMA)
    reqs = [
        (str(i), p, SamplingParams(n=2, temperature=0, max_tokens=100, structured=so, thinking=Thinking(e, b)))
        for i, (p, e, b, _) in enumerate(reference)
    ]
    reqs.append(("plain", PROMPTS[0], SamplingParams(temperature=0, max_tokens=100, structured=so)))
    done = _run(eng, reqs)
    for i, (_, e, b, want) in enumerate(reference):
        assert [c.token_ids for c in done[str(i)]] == [want, want]
        if b is not None:
            assert _marker_at(want, e) == b
        jsonschema.validate(json.loads(done[str(i)][0].text.partition(eng.tokenizer.decode(e))[2]), SCHEMA)
    jsonschema.validate(json.loads(done["plain"][0].text), SCHEMA)  # no thinking: the grammar from token 0
    if spec is not None:
        assert eng.stats().spec_accepted_tokens > 0


def _batch(end):
    """A thinking request (n=3), a plain constrained one, a budget without a grammar, and a request
    that starts after thinking (in_thinking=False): the grammar applies from its first token."""
    so = StructuredOutputs(json=SCHEMA)
    return [
        ("think", PROMPTS[0], SamplingParams(n=3, seed=7, max_tokens=100, structured=so, thinking=Thinking(end, 9))),
        ("plain", PROMPTS[1], SamplingParams(n=2, seed=8, max_tokens=100, structured=so)),
        ("budget-only", PROMPTS[2], SamplingParams(seed=9, max_tokens=20, ignore_eos=True, thinking=Thinking(end, 4))),
        (
            "answered",
            PROMPTS[0],
            SamplingParams(seed=10, max_tokens=100, structured=so, thinking=Thinking(end, 4, in_thinking=False)),
        ),
    ]


def _check_batch(done, end) -> None:
    assert len({tuple(c.token_ids) for c in done["think"]}) == 3  # each sample its own
    for c in done["think"]:
        _json_after(c, end, 9)
    for c in done["plain"] + done["answered"]:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    (c,) = done["budget-only"]
    assert _marker_at(c.token_ids, end) == 4 and len(c.token_ids) == 20  # unconstrained after the marker


def test_n_and_a_mixed_batch_each_per_request(engine, end):
    """Together or one at a time (seeded), each request gets the same tokens: its state is its own."""
    together = _run(engine, _batch(end))
    _check_batch(together, end)
    for rid, prompt, params in _batch(end):
        alone = _run(engine, [(rid, prompt, params)])[rid]
        assert [c.token_ids for c in alone] == [c.token_ids for c in together[rid]], rid


def test_preemption_by_recompute_keeps_the_state(llama_dir, engine, end):
    """A KV cache too small for the batch: sequences are preempted (recompute) mid-thinking and
    mid-answer, and still produce exactly the tokens they produce unpreempted."""
    sched = SchedulerConfig(max_num_seqs=8, preemption_mode="recompute")
    small = LLMEngine.from_checkpoint(llama_dir, EngineConfig(num_kv_blocks=10, scheduler=sched))
    got = _run(small, _batch(end))
    assert small.stats().preemptions > 0
    want = _run(engine, _batch(end))
    assert {r: [c.token_ids for c in o] for r, o in got.items()} == {
        r: [c.token_ids for c in o] for r, o in want.items()
    }


def test_prune_proposals_across_the_end_of_thinking(engine, end):
    """Proposals are cut where the forced marker disagrees, kept through its end into the grammar,
    cut where the grammar refuses; the state is where it was before."""
    tok = engine.tokenizer
    params = SamplingParams(structured=StructuredOutputs(json=SCHEMA), thinking=Thinking(end, budget=1))
    seq = Sequence(0, "r", 0, [1], params)
    seq.grammar = engine.grammars.sequence_grammar(params)
    x, brace, quote = tok.token_to_id("x"), tok.token_to_id("{"), tok.token_to_id('"')
    seq.spec_token_ids = [x, x, *end]
    prune_proposals([seq])
    assert seq.spec_token_ids == [x]  # the second token must be the marker's first
    seq.spec_token_ids = [x, *end, brace, quote, x]
    prune_proposals([seq])
    assert seq.spec_token_ids == [x, *end, brace, quote]  # "{\"x" is no key of SCHEMA
    logits = torch.zeros(1, engine.vocab_size)
    mask_logits(logits, [seq])
    assert torch.isfinite(logits[0]).all()  # still at the start: thinking, under the budget


def test_sequence_grammar_against_the_definition():
    """Random outputs over a small alphabet, a marker that overlaps itself, budgets or none: thinking
    ends where the output first ends with the marker (brute force over the whole output), the
    budget forces the marker from its position, and the state kept stays the marker's length."""
    rng = random.Random(0)
    marker = [5, 6, 5, 7]
    for trial in range(300):
        budget = rng.choice([None, 0, 1, 3, 8, 20])
        g, out = SequenceGrammar(None, marker, budget, in_thinking=True), []
        while g.in_thinking:
            forced = g.forced_token()
            want = marker[len(out) - budget] if budget is not None and len(out) >= budget else None
            assert forced == want, (trial, out)
            token = forced if forced is not None else rng.choice([5, 6, 7, 9])
            g.accept(token)
            out.append(token)
            assert len(g.recent) <= len(marker) and g.num_thought == len(out)
        assert _marker_at(out, marker) == len(out) - len(marker)  # the first complete marker ends it
        assert budget is None or len(out) <= budget + len(marker)


@pytest.mark.parametrize(
    "thinking, names",
    [
        (Thinking([]), "thinking.end_token_ids"),
        (Thinking([5, -1]), "thinking.end_token_ids"),
        (Thinking([5, 320]), "thinking.end_token_ids contains 320, outside the vocabulary"),
        (Thinking("</think>"), "thinking.end_token_ids"),
        (Thinking([5], budget=-1), "thinking.budget"),
        (Thinking([5], budget=2.0), "thinking.budget"),
        (Thinking([5], budget=True), "thinking.budget"),
        (Thinking([5], in_thinking="yes"), "thinking.in_thinking"),
        ({"end_token_ids": [5]}, "thinking must be a Thinking"),
    ],
)
def test_bad_thinking_is_refused_naming_the_field(engine, thinking, names):
    with pytest.raises(ValueError, match=names):
        engine.add_request("bad", "hello", SamplingParams(thinking=thinking))
    assert not engine.requests and not engine.scheduler.waiting


def test_triton_json_sampling_parameters():
    """KServe/Triton's sampling_parameters JSON carries thinking (and a structural tag); bad ones
    are INVALID_ARGUMENT naming the field."""
    p = from_json('{"thinking": {"end_token_ids": [3, 4], "budget": 5}, "structured": {"structural_tag": "{}"}}')
    assert p.thinking == Thinking([3, 4], 5) and p.structured == StructuredOutputs(structural_tag="{}")
    for text, names in [
        ('{"thinking": [3]}', "thinking must be a JSON object"),
        ('{"thinking": {"budget": 3}}', "end_token_ids is required"),
        ('{"thinking": {"end_token_ids": [3], "budgets": 3}}', "unknown field 'budgets'"),
        ('{"thinking": {"end_token_ids": [3], "budget": -3}}', "thinking.budget"),
        ('{"structured": {"structural_tag": "[1]"}}', "structured.structural_tag must be a JSON object"),
    ]:
        with pytest.raises(RpcError, match=names) as e:
            from_json(text)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
