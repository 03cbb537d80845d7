"""Scheduler policy: decodes are never stalled by long prompts, priorities order admission,
aging prevents starvation, and the KV pool is sized from a byte budget."""

from __future__ import annotations

import pytest
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.block_manager import BlockManager
from baton.serve.scheduling.scheduler import Scheduler, SchedulerConfig

from .conftest import make_hf_checkpoint


def _seq(i, n, priority=0, arrival=0.0):
    return Sequence(i, str(i), 0, list(range(1, n + 1)), SamplingParams(), priority=priority, arrival_time=arrival)


def test_long_prompt_is_chunked_and_decodes_keep_running():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockManager(64, 4))
    short = _seq(0, 3, arrival=0.0)
    sched.add(short)
    out = sched.schedule()
    short.num_computed_tokens += 3
    short.token_ids.append(7)  # sampled: now a decode
    sched.add(_seq(1, 100, arrival=1.0))
    for _ in range(5):
        out = sched.schedule()
        got = dict((s.seq_id, n) for s, n in out.scheduled)
        assert got[0] == 1, "the running decode must be scheduled every step"
        assert got[1] == 15, "the long prompt takes what is left of the budget"
        for s, n in out.scheduled:
            s.num_computed_tokens += n
        short.token_ids.append(7)


def test_priority_orders_admission_and_aging_prevents_starvation():
    cfg = SchedulerConfig(max_num_seqs=1, policy="priority", priority_aging_s=10.0)
    sched = Scheduler(cfg, BlockManager(64, 4))
    import time

    now = time.monotonic()
    low_old = _seq(0, 4, priority=5, arrival=now - 100.0)  # waited 100 s: aged by 10 levels
    high_new = _seq(1, 4, priority=0, arrival=now)
    low_new = _seq(2, 4, priority=5, arrival=now)
    for s in (low_new, high_new, low_old):
        sched.add(s)
    assert [s.seq_id for s, _ in sched.schedule().scheduled] == [0]
    sched.finish(low_old)
    assert [s.seq_id for s, _ in sched.schedule().scheduled] == [1]
    sched.finish(high_new)
    assert [s.seq_id for s, _ in sched.schedule().scheduled] == [2]


def test_fcfs_preempts_the_newest():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(4, 4))
    a, b = _seq(0, 7, arrival=0.0), _seq(1, 7, arrival=1.0)
    sched.add(a)
    sched.add(b)
    assert [s.seq_id for s, _ in sched.schedule().scheduled] == [0, 1]  # 2 blocks each
    for s in (a, b):
        s.num_computed_tokens = 7
        s.token_ids += [5, 5]  # each now needs a third block; only 4 exist
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == [1] and [s.seq_id for s, _ in out.scheduled] == [0]
    assert b.num_computed_tokens == 0 and b in sched.waiting and not b.block_table


def test_kv_pool_sized_from_byte_budget(tmp_path):
    _, ckpt = make_hf_checkpoint(tmp_path, "llama")
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(block_size=16, kv_cache_bytes=4 * 2**20))
    # 2 layers x 2 (K,V) x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block
    assert engine.block_manager.num_blocks == 4 * 2**20 // 8192
    with pytest.raises(ValueError, match="holds no"):
        LLMEngine.from_checkpoint(ckpt, EngineConfig(block_size=16, kv_cache_bytes=100))
    frac = LLMEngine.from_checkpoint(ckpt, EngineConfig(block_size=16, kv_cache_fraction=0.001))
    assert frac.block_manager.num_blocks > 0


def test_pipelined_batches_split_the_sequences_and_never_touch_one_in_flight():
    """Pipelined steps (pipeline parallelism): a batch in flight keeps its sequences; the next batch
    takes others, at most max_seqs, and when the pool runs out it preempts one not in flight."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(5, 4))
    seqs = [_seq(i, 4, arrival=float(i)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule(max_seqs=2)
    assert [s.seq_id for s, _ in first.scheduled] == [0, 1]
    busy = {s.seq_id for s, _ in first.scheduled}
    second = sched.schedule(exclude=busy, max_seqs=2)
    assert [s.seq_id for s, _ in second.scheduled] == [2, 3]
    for out in (first, second):
        for s, n in out.scheduled:
            s.num_computed_tokens += n
            s.token_ids += [7] * 4  # each now needs a second block; one block is left
    in_flight = {s.seq_id for s, _ in second.scheduled}  # the newest: FCFS would preempt them first
    third = sched.schedule(exclude=in_flight, max_seqs=4)
    assert [s.seq_id for s, _ in third.scheduled] == [0]
    assert [s.seq_id for s in third.preempted] == [1]
    assert len(seqs[2].block_table) == len(seqs[3].block_table) == 1  # in flight: untouched
