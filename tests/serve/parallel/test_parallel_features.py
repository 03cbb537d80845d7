"""Every engine feature on a sharded model gives the single-process engine's outputs.

Each group is one engine configuration, run once in-process (T=1, the reference) and once per
layout on real worker processes; requests are added between step() calls, so prefills arrive
while others decode. Groups: mixed (prefix caching over shared prefixes, chunked prefill mixed
with decodes, n > 1 copy-on-write forks greedy and seeded, logprobs, stop strings), preemption
by recompute (fp8 KV) and by swap (int8 KV) in a tiny pool, StreamingLLM, and speculative
decoding by n-gram (under swap preemption), draft model (unsharded on the driver) and Medusa
(hidden states from the last stage, tree verification). Speculative output must also equal
plain greedy decoding.

n > 1 with temperature: each sample draws from its own seeded generator (seed + index), so the
tokens depend on the logits alone. Sharded logits differ from T=1's by float rounding (~1e-6,
the all-reduce sums in another order); a seeded draw flips only when its uniform lands within
that distance of a CDF boundary, about 1e-6 per token, and the weights and seeds are fixed, so
the comparison is exact and stable. Greedy n > 1 (identical samples) checks the forks' copied
blocks on every rank: a child whose copy-on-write block was not copied on some rank attends to
zeros there and diverges."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from baton.common.checkpoint import load_checkpoint, save_model
from baton.common.config import ModelConfig
from baton.common.medusa import MedusaConfig, MedusaHeads, save_medusa
from baton.common.model import build_model, greedy_generate
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.parallel.loader import weight_bytes
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

from .conftest import Arrival, OpsSpy, check_really_sharded, drive, random_prompts, sharded, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
LENGTHS = (3, 41, 17, 60, 6, 33)
LOOP = [7, 8, 9, 10, 11] * 8  # n-gram lookup finds proposals here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, llama_dir):
    """llama_dir (a real BPE tokenizer, for stop strings) with Medusa heads beside it, and a
    one-layer draft made of the target's first layer (it often agrees)."""
    d = tmp_path_factory.mktemp("parallel-features")
    shutil.copytree(llama_dir, d / "target")
    target = load_checkpoint(d / "target").model
    heads = MedusaHeads(MedusaConfig(target.config.hidden_size, target.config.vocab_size, num_heads=3))
    heads.init_from_lm_head(target.lm_head)
    save_medusa(heads, d / "target")
    draft = build_model(ModelConfig(**{**dataclasses.asdict(target.config), "num_hidden_layers": 1}), seed=0)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if ".layers.1." not in k})
    save_model(d / "draft", draft)
    return d


def _plain(vocab: int, extra: tuple[list[int], ...] = ()) -> list[Arrival]:
    prompts = random_prompts(vocab, LENGTHS) + list(extra)
    return [Arrival(2 * i, str(i), p, GREEDY) for i, p in enumerate(prompts)]


def _mixed(vocab: int, stop: str) -> list[Arrival]:
    prefix, *tails = random_prompts(vocab, (24, 5, 9, 2, 13, 45), seed=1)  # 24 = three shared blocks
    seeded = SamplingParams(temperature=0.8, n=2, seed=1234, max_tokens=20, ignore_eos=True, logprobs=3)
    return [
        Arrival(0, "prefix-a", prefix + tails[0], GREEDY),
        Arrival(1, "seeded-n2", tails[3], seeded),
        Arrival(2, "long", tails[4], GREEDY),  # 45 tokens in chunks of at most 16, beside decodes
        Arrival(3, "prefix-logprobs", prefix + tails[1], dataclasses.replace(GREEDY, logprobs=5)),
        Arrival(4, "text-stop", "The quick brown fox", dataclasses.replace(GREEDY, max_tokens=30, stop=[stop])),
        Arrival(5, "prefix-greedy-n3", prefix + tails[2], dataclasses.replace(GREEDY, n=3)),
    ]


def _groups(d) -> dict[str, EngineConfig]:
    return {
        "plain": EngineConfig(num_kv_blocks=96, block_size=8),  # the speculative groups' reference
        "mixed": EngineConfig(num_kv_blocks=96, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=16)),
        "recompute-fp8": EngineConfig(
            num_kv_blocks=18, kv_cache_dtype="fp8", block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=32)
        ),
        "swap-int8": EngineConfig(
            num_kv_blocks=18,
            kv_cache_dtype="int8",
            block_size=8,
            scheduler=SchedulerConfig(max_num_batched_tokens=32, preemption_mode="swap"),
        ),
        "streaming": EngineConfig(num_kv_blocks=32, block_size=8, streaming_sink_tokens=4, streaming_window_tokens=24),
        "ngram": EngineConfig(
            num_kv_blocks=22,
            block_size=8,
            speculative=SpeculativeConfig("ngram", 4),
            scheduler=SchedulerConfig(max_num_batched_tokens=24, preemption_mode="swap"),
        ),
        "draft": EngineConfig(
            num_kv_blocks=96, block_size=8, speculative=SpeculativeConfig("draft", 4, draft_model=str(d / "draft"))
        ),
        "medusa": EngineConfig(
            num_kv_blocks=96, block_size=8, speculative=SpeculativeConfig("medusa", 3, tree_width=2)
        ),
    }


RUNS = [
    (g, layout)
    for g in ("mixed", "recompute-fp8", "swap-int8", "streaming", "ngram", "draft")
    for layout in ("T2", "P2")
]
RUNS += [("medusa", "T2"), ("medusa", "T2xP2")]


@pytest.fixture(scope="module")
def workloads(model_dir) -> dict[str, list[Arrival]]:
    single = LLMEngine.from_checkpoint(model_dir / "target", EngineConfig(num_kv_blocks=96, block_size=8))
    vocab = single.vocab_size
    text = drive(single, [Arrival(0, "probe", "The quick brown fox", dataclasses.replace(GREEDY, max_tokens=30))])
    text = text["probe"].outputs[0].text
    assert len(text) >= 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # appears in the greedy output: it must stop there
    plain = _plain(vocab, (LOOP,))
    streaming = [Arrival(0, "0", random_prompts(vocab, (10,))[0], dataclasses.replace(GREEDY, max_tokens=70))]
    streaming.append(
        Arrival(3, "1", random_prompts(vocab, (21,), seed=2)[0], dataclasses.replace(GREEDY, max_tokens=50))
    )
    return {"mixed": _mixed(vocab, stop), "streaming": streaming} | {
        g: plain for g in ("plain", "recompute-fp8", "swap-int8", "ngram", "draft", "medusa")
    }


@pytest.fixture(scope="module")
def references(model_dir, workloads):
    """Each group's T=1 run (outputs, block-op counts, the engine), checked to really use its feature."""
    groups, cache = _groups(model_dir), {}

    def get(group: str):
        if group not in cache:
            engine = LLMEngine.from_checkpoint(model_dir / "target", groups[group])
            spy = OpsSpy(engine.runner)
            outs = drive(engine, workloads[group])
            _check_feature_used(group, engine, spy, outs)
            if group == "plain":  # and plain decoding is the reference decoder's (no cache, no engine)
                for a in workloads[group]:
                    want = greedy_generate(engine.model, torch.tensor([a.prompt]), a.params.max_tokens)[0].tolist()
                    assert outs[a.request_id].outputs[0].token_ids == want
            cache[group] = outs, spy.counts, engine
        return cache[group]

    return get


def _check_feature_used(group: str, engine: LLMEngine, spy: OpsSpy, outs) -> None:
    if group == "mixed":
        assert engine.block_manager.prefix_hit_rate > 0
        assert spy.counts["copies"] > 0, "the n > 1 forks copied no block"
        assert outs["text-stop"].outputs[0].finish_reason == "stop"
        a, b = (c.token_ids for c in outs["seeded-n2"].outputs)
        assert a != b, "the seeded samples should diverge"
        assert len({tuple(c.token_ids) for c in outs["prefix-greedy-n3"].outputs}) == 1
    if group in ("recompute-fp8", "swap-int8", "ngram"):
        assert engine.scheduler.num_preemptions > 0
    if group in ("swap-int8", "ngram"):
        assert spy.counts["swap_out"] > 0 and spy.counts["swap_in"] > 0
    if group == "streaming":
        assert spy.counts["rerotations"] > 0
    if engine.speculative is not None:
        assert engine.speculative.stats.proposed > 0
        if group != "medusa":  # the loop prompt / the agreeing draft get proposals accepted
            assert engine.speculative.stats.accepted > 0


def _assert_same(got, want) -> None:
    assert tokens(got) == tokens(want)
    for rid, out in want.items():
        for g, w in zip(got[rid].outputs, out.outputs):
            assert (g.text, g.finish_reason, g.stop_reason) == (w.text, w.finish_reason, w.stop_reason), rid
            assert (g.logprobs is None) == (w.logprobs is None), rid
            for lg, lw in zip(g.logprobs or [], w.logprobs or []):
                assert lg.keys() == lw.keys(), rid
                for t in lw:
                    assert lg[t] == pytest.approx(lw[t], abs=1e-4), (rid, t)


@pytest.mark.slow
@pytest.mark.parametrize("group,layout", RUNS)
def test_feature_on_sharded_model_equals_single_process(model_dir, workloads, references, group, layout):
    want, counts, single = references(group)
    whole = weight_bytes(single.model)
    with sharded(model_dir / "target", _groups(model_dir)[group], layout) as llm:
        engine = llm.engine
        spy = OpsSpy(engine.runner)
        got = drive(engine, workloads[group])
        check_really_sharded(engine, layout, whole)
        _check_feature_used(group, engine, spy, got)
        for kind in ("copies", "rerotations"):  # the same forks and evictions (host pools differ: per rank)
            assert spy.counts[kind] == counts[kind], kind
    _assert_same(got, want)
    if engine.speculative is not None:  # exact: plain greedy decoding's tokens
        assert tokens(got) == tokens(references("plain")[0])
        # The same proposals as T=1 (Medusa's come from the hidden states the last stage sends back).
        assert engine.speculative.stats == single.speculative.stats
