"""The per-step control-plane message: what a worker rebuilds from the wire is the driver's plan,
and the block tables travel as deltas (a decode step sends no table at all)."""

from __future__ import annotations

import pickle
import random

from baton.serve.core.sequence import Sequence
from baton.serve.runner.step_plan import StepPlan, TableReceiver, TableSender, plan_chunks, split_for_pipeline
from baton.serve.sampling_params import SamplingParams

BS = 4


def _seq(i: int, n: int) -> Sequence:
    seq = Sequence(i, f"r{i}", 0, list(range(100 + i, 100 + i + n)), SamplingParams())
    seq.block_table = list(range(10 * i, 10 * i + -(-n // BS)))
    return seq


def _roundtrip(sender: TableSender, receiver: TableReceiver, scheduled):
    chunks, _ = plan_chunks(scheduled)
    want = StepPlan.from_chunks(chunks, BS)
    wire = pickle.loads(pickle.dumps(sender.encode(chunks, False, True, False)))
    assert receiver.decode(wire, BS) == want
    return wire


def test_workers_rebuild_the_drivers_plan_through_table_changes():
    rng = random.Random(0)
    seqs = [_seq(i, rng.randint(3, 30)) for i in range(6)]
    sender, receiver = TableSender(), TableReceiver()
    _roundtrip(sender, receiver, [(s, s.num_tokens) for s in seqs])  # prefill: whole tables go out
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
    for step in range(12):
        for s in seqs:
            s.token_ids.append(7)
            if s.num_tokens > len(s.block_table) * BS:
                s.block_table.append(500 + 10 * step + s.seq_id)
        if step == 3:  # preempted and recomputed: a whole new table
            seqs[0].block_table = [900 + b for b in range(len(seqs[0].block_table))]
        if step == 5:  # StreamingLLM-style eviction from the front
            seqs[1].block_table = seqs[1].block_table[1:]
            seqs[1].num_evicted_tokens += BS
        if step == 7:  # a sequence leaves; its id is forgotten by the workers with the next step
            sender.release(seqs[2].seq_id)
            seqs.pop(2)
        wire = _roundtrip(sender, receiver, [(s, 1) for s in seqs])
        if step not in (3, 5, 7):
            assert sum(len(c.block_table) for c in wire.chunks) <= len(seqs)  # at most the new blocks
        for s in seqs:
            s.num_computed_tokens += 1
    assert set(receiver.tables) == {s.seq_id for s in seqs}


def test_a_decode_step_sends_a_few_bytes_per_sequence():
    seqs = [_seq(i, 120) for i in range(64)]
    sender = TableSender()
    chunks, _ = plan_chunks([(s, 1) for s in seqs])
    full = len(pickle.dumps(sender.encode(chunks, False, True, False)))
    for s in seqs:
        s.num_computed_tokens = 119
    chunks, _ = plan_chunks([(s, 1) for s in seqs])
    delta = len(pickle.dumps(sender.encode(chunks, False, True, False)))
    plan = len(pickle.dumps(StepPlan.from_chunks(chunks, BS)))
    assert delta < full and delta < plan / 2, (delta, full, plan)


def test_pipeline_micro_batches_keep_every_sequence_once_in_order():
    seqs = [(_seq(i, 5), n) for i, n in enumerate([1, 1, 40, 1, 3, 60, 1])]
    for parts in (1, 2, 3):
        groups = split_for_pipeline(seqs, parts)
        assert [x for g in groups for x in g] == seqs and 1 <= len(groups) <= parts and all(groups)
