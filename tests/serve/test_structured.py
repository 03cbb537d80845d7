"""Structured outputs: every sampled output (temperature 1, many seeds) parses and validates, with and
without speculation and under preemption; greedy constrained output equals an independent reference
(HF transformers logits masked by xgrammar, argmax); a spec xgrammar rejects is a ValueError before
anything is scheduled, and the engine goes on serving."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
import torch
import transformers
import xgrammar as xgr
from baton.serve import proto
from baton.serve.client import BatonClient
from baton.serve.core.sequence import Sequence
from baton.serve.core.structured import StructuredOutputs
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.grammar import json_schema_ebnf, mask_logits, prune_proposals
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

SCHEMAS = {
    "required": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
    },
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "ints": {
        "type": "array",
        "items": {"type": "integer", "minimum": -50, "maximum": 50},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["point", "tags"],
    },
}
REGEX = r"[a-z]{1,5}@[a-z]{1,5}\.(com|org)"
PROMPTS = ['{"name": "ab", "age": 3, "ok": true} ', "The quick brown fox", "def f(x):"]


def _specs():
    return [("json", s, StructuredOutputs(json=s)) for s in SCHEMAS.values()] + [
        ("regex", REGEX, StructuredOutputs(regex=REGEX))
    ]


def _check(kind, spec, text: str) -> None:
    if kind == "regex":
        assert re.fullmatch(spec, text), text
    else:
        jsonschema.validate(json.loads(text), spec)


def _run(engine, requests) -> dict[str, list]:
    """requests: (id, prompt, params); all in flight together. Returns each request's completions."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs
    return done


def _sample_all(engine, seeds=range(4), n=2) -> int:
    """Every spec x seed x prompt, n samples each, at temperature 1: all parse and validate."""
    reqs, kinds = [], {}
    for si, (kind, spec, so) in enumerate(_specs()):
        for seed in seeds:
            rid = f"{si}-{seed}"
            params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=96, structured=so)
            reqs.append((rid, PROMPTS[seed % len(PROMPTS)], params))
            kinds[rid] = (kind, spec)
    done = _run(engine, reqs)
    for rid, outs in done.items():
        assert len(outs) == n
        for c in outs:
            assert c.finish_reason == "stop", (rid, c.text)
            _check(*kinds[rid], c.text)
    return len(done) * n


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine.from_checkpoint(llama_dir)


def test_sampled_outputs_validate(engine):
    assert _sample_all(engine) == 40
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sampled_outputs_validate_with_ngram_speculation_and_preemption(llama_dir):
    sched = SchedulerConfig(max_num_seqs=8, preemption_mode="recompute")
    cfg = EngineConfig(num_kv_blocks=12, scheduler=sched, speculative=SpeculativeConfig("ngram", 4))
    eng = LLMEngine.from_checkpoint(llama_dir, cfg)
    _sample_all(eng, seeds=range(3))
    st = eng.stats()
    assert st.spec_accepted_tokens > 0 and st.preemptions > 0  # both paths were exercised


def _reference(hf, info, prompt_ids, compiled, max_tokens) -> list[int]:
    """Token by token: full-model logits, masked by xgrammar's own matcher, argmax."""
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    ids, out = list(prompt_ids), []
    while len(out) < max_tokens and not m.is_terminated():
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[:, -1].float()
        m.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        assert m.accept_token(token)
        ids.append(token)
        out.append(token)
    return out


@pytest.fixture(scope="module")
def references(llama_dir):
    """The reference's greedy tokens for each spec, and for one unconstrained prompt (HF generate)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir.parent / "hf-llama").eval()
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)  # the checkpoint's own files, not the engine's loader
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    want = {}
    for si, (kind, spec, _) in enumerate(_specs()):
        # the schema's grammar text is the spec; matching, masking and decoding are xgrammar's own here
        compiled = compiler.compile_regex(spec) if kind == "regex" else compiler.compile_grammar(json_schema_ebnf(spec))
        ids = tok.encode(PROMPTS[si % len(PROMPTS)], add_special_tokens=False)
        want[str(si)] = _reference(hf, info, ids, compiled, 64)
        assert want[str(si)][-1] == tok.eos_token_id  # the reference ended by completing the structure
    with torch.no_grad():
        ids = torch.tensor([tok.encode(PROMPTS[1], add_special_tokens=False)])
        want["free"] = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, -8:].tolist()
    return want


@pytest.mark.parametrize("speculative", [None, "ngram", "draft-tree"])
def test_greedy_equals_reference(llama_dir, engine, references, speculative):
    """n=2 constrained samples beside an unconstrained request; speculation on or off. The draft is
    the target itself, so its trees are deep and pruned by the grammar (prune_proposals)."""
    spec = {
        "ngram": SpeculativeConfig("ngram", 3),
        "draft-tree": SpeculativeConfig("draft", 3, draft_model=str(llama_dir), tree_width=2),
    }.get(speculative)
    eng = engine if spec is None else LLMEngine.from_checkpoint(llama_dir, EngineConfig(speculative=spec))
    reqs = [
        (str(si), PROMPTS[si % len(PROMPTS)], SamplingParams(n=2, temperature=0, max_tokens=64, structured=so))
        for si, (_, _, so) in enumerate(_specs())
    ]
    reqs.append(("free", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    done = _run(eng, reqs)
    assert [c.token_ids for c in done.pop("free")] == [references["free"]]
    assert {rid: [c.token_ids for c in outs] for rid, outs in done.items()} == {
        rid: [tokens, tokens] for rid, tokens in references.items() if rid != "free"
    }
    if spec is not None:
        assert eng.stats().spec_accepted_tokens > 0


def test_prune_proposals(engine):
    """Chains keep their allowed prefix (and its draft rows), trees their allowed subtrees; the
    matcher is left where it was."""
    tok = engine.tokenizer
    a, b, c, x = (tok.token_to_id(ch) for ch in "abcx")
    seq = Sequence(0, "r", 0, [1], SamplingParams())
    seq.grammar = engine.grammars.matcher(StructuredOutputs(regex="abc+"))
    seq.spec_token_ids, seq.spec_draft_probs = [a, b, x, c], torch.arange(4.0).unsqueeze(1)
    prune_proposals([seq])
    assert seq.spec_token_ids == [a, b] and seq.spec_draft_probs.flatten().tolist() == [0.0, 1.0]
    #        a(0)          x(1)        tree: parents before children
    #     b(2)  x(3)       c(5)
    #   c(4)
    seq.spec_token_ids, seq.spec_parents, seq.spec_draft_probs = [a, x, b, x, c, c], [-1, -1, 0, 0, 2, 1], None
    prune_proposals([seq])
    assert (seq.spec_token_ids, seq.spec_parents) == ([a, b, c], [-1, 0, 1])
    seq.spec_token_ids, seq.spec_parents = [x, a], [-1, 0]
    prune_proposals([seq])
    assert (seq.spec_token_ids, seq.spec_parents) == ([], None)
    logits = torch.zeros(1, engine.vocab_size)
    mask_logits(logits, [seq])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [a]  # the matcher is still at the start


def test_json_strings_exclude_what_json_forbids(llama_dir):
    """xgrammar's own schema grammar lets strings hold UTF-16 surrogates (invalid UTF-8) and, under
    maxLength, control characters; ours refuses both and changes nothing else."""
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, stop_token_ids=[tok.eos_token_id]))
    for schema in ({"type": "string"}, {"type": "string", "maxLength": 8}):
        stock = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
        ours = json_schema_ebnf(schema)
        assert ours != stock and re.sub(r"\[\^[^\]]*\]", "", ours) == re.sub(r"\[\^[^\]]*\]", "", stock)
        for text, ok in [("\ud834".encode("utf-8", "surrogatepass"), False), (b"\x06", False), ("é🦊a".encode(), True)]:
            m = xgr.GrammarMatcher(compiler.compile_grammar(ours))
            assert m.accept_string(b'"') and m.accept_string(text) is ok, (schema, text)


def test_json_object_and_grammar(engine):
    reqs = [
        (
            f"o{s}",
            PROMPTS[0],
            SamplingParams(temperature=1, seed=s, max_tokens=160, structured=StructuredOutputs(json_object=True)),
        )
        for s in range(4)
    ]
    yes_no = StructuredOutputs(grammar='root ::= ("yes" | "no") " " [0-9]')
    reqs += [
        (f"g{s}", PROMPTS[1], SamplingParams(temperature=1, seed=s, max_tokens=16, structured=yes_no)) for s in range(4)
    ]
    done = _run(engine, reqs)
    objects = [json.loads(done[f"o{s}"][0].text) for s in range(4) if done[f"o{s}"][0].finish_reason == "stop"]
    assert objects and all(isinstance(o, dict) for o in objects)
    assert all(re.fullmatch(r"(yes|no) [0-9]", done[f"g{s}"][0].text) for s in range(4))


@pytest.mark.parametrize(
    "so, names",
    [
        (StructuredOutputs(json={"type": "frobnicate"}), "JSON schema"),
        (StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "JSON schema"),
        (StructuredOutputs(regex="(ab"), "regex"),
        (StructuredOutputs(grammar="root ::= undefined_rule"), "EBNF grammar"),
        (StructuredOutputs(json="{not json"), "not valid JSON"),
        (StructuredOutputs(regex="a", json_object=True), "exactly one"),
        (StructuredOutputs(), "exactly one"),
    ],
)
def test_invalid_spec_is_refused_before_scheduling(engine, so, names):
    with pytest.raises(ValueError, match=names):
        engine.add_request("bad", "hello", SamplingParams(structured=so))
    assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
    done = _run(engine, [("after", "hello", SamplingParams(max_tokens=4, structured=StructuredOutputs(regex="[ab]+")))])
    assert re.fullmatch("[ab]+", done["after"][0].text)


def test_grpc_and_kserve(llama_dir):
    """The Baton proto's `structured` oneof and KServe's sampling_parameters.structured reach the
    engine; a rejected spec is INVALID_ARGUMENT naming it, and the server goes on serving."""
    from .server_fixtures import ServerThread
    from .test_server_bad_input import MODEL_INFER, call_raw, kserve_bytes

    server = ServerThread(llama_dir)
    try:
        with BatonClient(server.target, timeout=60) as c:
            so = proto.baton("StructuredOutputs")
            schema = SCHEMAS["enum"]
            for seed in range(3):
                out = c.complete("The fox", max_tokens=32, seed=seed, structured=so(json=json.dumps(schema)))
                jsonschema.validate(json.loads(out.completions[0].text), schema)
                assert out.completions[0].finish_reason == "stop"
            with pytest.raises(grpc.RpcError) as e:
                c.complete("The fox", structured=so(regex="(ab"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                c.complete("The fox", structured=so())
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exactly one" in e.value.details()
            assert c.complete("The lazy dog", max_tokens=3, temperature=0).finished
        sampling = json.dumps({"max_tokens": 16, "structured": {"regex": "[0-9]{3}"}}).encode()
        with grpc.insecure_channel(server.target) as ch:
            raw = ch.unary_unary(MODEL_INFER)(kserve_bytes(sampling=sampling), timeout=60)
        reply = proto.kserve("ModelInferResponse").FromString(raw)
        assert re.fullmatch(
            rb"The fox[0-9]{3}", reply.raw_output_contents[0][4:]
        )  # Triton's text_output: prompt + output
        with pytest.raises(grpc.RpcError) as e:
            call_raw(server.target, MODEL_INFER, kserve_bytes(sampling=b'{"structured": {"json": {"type": 7}}}'), False)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "JSON schema" in e.value.details()
    finally:
        server.stop()


def test_a_model_xgrammar_cannot_read_still_serves(llama_dir, monkeypatch, caplog):
    """Servers build the grammar compiler when the model loads; if xgrammar cannot take the model's
    tokenizer, loading goes on (a warning says why) and each structured request is refused with
    that reason, while unconstrained requests are served."""

    def unreadable(*args, **kwargs):
        raise RuntimeError("this vocabulary cannot be read")

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", unreadable)
    engine = LLMEngine.from_checkpoint(llama_dir)
    with caplog.at_level("WARNING", logger="baton.serve.grammar"):
        engine.grammars.prepare()
    assert "structured outputs are unavailable for this model: RuntimeError: this vocabulary" in caplog.text
    spec = SamplingParams(max_tokens=4, structured=StructuredOutputs(regex="[a-z]+"))
    with pytest.raises(ValueError, match="^structured outputs are unavailable for this model"):
        engine.add_request("constrained", "The", spec)
    engine.add_request("plain", "The", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in finals] == [("plain", 3)]
