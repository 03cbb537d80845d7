"""Admission refuses, with a message, what the batch or the KV pool could never hold - and
nothing that could be served: the boundary cases run to completion. The engine serves on
afterwards, and no admitted request ever hits the scheduler's "no progress" path."""

from __future__ import annotations

import pytest
from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

from .test_fault_isolation import _rand, drive, pool_whole


def params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True)


def served(engine: LLMEngine, plan) -> dict:
    """Run the plan; every request must finish by length, none with an error."""
    finals = drive(engine, plan)
    assert {rid: out.error for rid, out in finals.items()} == {rid: None for _, rid, _, _ in plan}
    assert all(c.finish_reason == "length" for out in finals.values() for c in out.outputs)
    assert pool_whole(engine)
    return finals


def refused(engine: LLMEngine, prompt, p: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("refused", prompt, p)
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_work()
    served(engine, [(0, "after", [t % 128 for t in _rand(7, 99)], params(5))])  # and the engine serves on


def test_n_is_bounded_by_max_num_seqs_and_forks_never_overfill_the_batch(llama_dir):
    engine = LLMEngine.from_checkpoint(
        llama_dir, EngineConfig(num_kv_blocks=64, block_size=8, scheduler=SchedulerConfig(max_num_seqs=4))
    )
    refused(engine, _rand(9, 1), params(4, n=5), r"n is 5, more than the 4 sequences a batch holds \(max_num_seqs\)")
    # the n=4 request arrives while another runs, and two more queue behind it: drive() checks the
    # batch never holds more than 4 sequences, though the forks join it after the prompt
    plan = [
        (0, "one", _rand(9, 2), params(6)),
        (1, "four", _rand(12, 3), params(6, n=4)),
        (1, "x", _rand(5, 4), params(6)),
        (2, "y", _rand(6, 5), params(6)),
    ]
    finals = served(engine, plan)
    assert len(finals["four"].outputs) == 4 and len({tuple(c.token_ids) for c in finals["four"].outputs}) == 1


def test_n_samples_need_a_block_each_beside_the_shared_prompt(llama_dir):
    engine = LLMEngine.from_checkpoint(llama_dir, EngineConfig(num_kv_blocks=4, block_size=8))
    prompt = _rand(20, 6)  # 2 full blocks shared by every sample
    refused(engine, prompt, params(4, n=3), "n=3 samples need 2 shared prompt blocks plus one block each")
    finals = served(engine, [(0, "two", prompt, params(4, n=2))])  # 2 + 2 blocks: exactly the pool
    assert len(finals["two"].outputs) == 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_sequence_must_fit_the_pool_to_the_block(llama_dir, mode):
    """4 blocks of 8: 32 prompt tokens and one new token fit (that token's KV is never computed),
    one more token of either does not."""
    engine = LLMEngine.from_checkpoint(
        llama_dir, EngineConfig(num_kv_blocks=4, block_size=8, scheduler=SchedulerConfig(preemption_mode=mode))
    )
    served(engine, [(0, "edge", _rand(32, 7), params(1))])
    refused(engine, _rand(32, 7), params(2), "cannot hold one sequence of 33 cached tokens")
    refused(engine, _rand(33, 8), params(1), "cannot hold one sequence of 33 cached tokens")
    # two that each need the whole pool at their end: they take turns (swapped out or recomputed)
    plan = [(0, "p", _rand(10, 9), params(23)), (0, "q", _rand(11, 10), params(22))]
    alone = {
        rid: served(
            LLMEngine.from_checkpoint(llama_dir, EngineConfig(num_kv_blocks=4, block_size=8)), [(0, rid, prompt, p)]
        )[rid]
        .outputs[0]
        .token_ids
        for _, rid, prompt, p in plan
    }
    finals = served(engine, plan)
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == alone
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine.block_manager.num_host_blocks > 0


def _small(n: int, seed: int) -> list[int]:
    return [t % 128 for t in _rand(n, seed)]  # the streaming model's vocabulary


@pytest.fixture(scope="module")
def streaming_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("streaming-capacity")
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    save_model(d / "m", build_model(cfg, seed=3))
    return d / "m"


def streaming(model_dir, blocks: int, **sched) -> LLMEngine:
    """4 sinks + a 24-token window in blocks of 4: after eviction a stream holds at most
    4 + 24 + 3 tokens plus the one it computes, 31 tokens = 8 blocks."""
    return LLMEngine.from_checkpoint(
        model_dir,
        EngineConfig(
            num_kv_blocks=blocks,
            block_size=4,
            streaming_sink_tokens=4,
            streaming_window_tokens=24,
            scheduler=SchedulerConfig(**sched),
        ),
    )


def test_streaming_needs_sinks_plus_window_in_the_pool(streaming_model):
    small = streaming(streaming_model, 7)
    refused(small, _small(6, 11), params(100), "cannot hold one sequence of 31 cached tokens")
    served(small, [(0, "short", _small(6, 11), params(20))])  # 25 tokens ever cached: fits 7 blocks
    engine = streaming(streaming_model, 8)
    peak = []
    finals = drive(
        engine,
        [(0, "long", _small(6, 11), params(300))],
        lambda step, outs: peak.append(engine.block_manager.num_used_blocks),
    )
    assert finals["long"].error is None and len(finals["long"].outputs[0].token_ids) == 300
    assert max(peak) <= 8 and pool_whole(engine)


def test_streaming_prompt_longer_than_the_pool(streaming_model):
    """With chunked prefill, a prompt longer than the pool is prefilled in chunks that fit, evicting
    between them; without it, the prompt must fit whole and a longer one is refused."""
    engine = streaming(streaming_model, 8)
    served(engine, [(0, "long-prompt", _small(50, 12), params(40))])
    whole = streaming(streaming_model, 8, enable_chunked_prefill=False, max_num_batched_tokens=64)
    refused(whole, _small(50, 12), params(40), "cannot hold one sequence of 50 cached tokens")
    served(whole, [(0, "fits", _small(30, 12), params(40))])


def test_streams_preempted_past_the_pool_re_prefill_in_chunks(streaming_model):
    """A long stream preempted by a more urgent one is recomputed (evicted KV cannot be swapped)
    from more tokens than the pool holds: it re-prefills in chunks that fit, and finishes."""
    engine = streaming(streaming_model, 15, policy="priority")  # 60 tokens; two windows need 16 blocks
    engine.add_request("long", _small(6, 13), params(150), priority=5)
    finals, step = {}, 0
    while engine.has_unfinished_requests():
        if step == 70:
            engine.add_request("urgent", _small(7, 14), params(60), priority=0)
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    assert {rid: (o.error, len(o.outputs[0].token_ids)) for rid, o in finals.items()} == {
        "long": (None, 150),
        "urgent": (None, 60),
    }
    assert finals["long"].metrics.num_preemptions > 0 and pool_whole(engine)
