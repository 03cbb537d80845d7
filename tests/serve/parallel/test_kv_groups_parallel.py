"""KV groups across ranks, without processes: the sliding layers' block tables reach the workers as
deltas that rebuild the driver's plan exactly, whatever changed them (a block leaving the window,
a swap, a recompute, a fork, a prefix hit), and the ranks agree on one pair of pool sizes that fits
each of them - a pipeline stage may hold layers of one group only. The sharded engines themselves
are served in test_families_parallel.py (greedy tokens, preemption, the per-rank pools)."""

from __future__ import annotations

import pickle
import random

from baton.serve.core.sequence import Sequence
from baton.serve.engine.sizing import group_split, window_demand
from baton.serve.parallel.tables import GroupTableReceiver, GroupTableSender
from baton.serve.parallel.worker import KVSizing, agree_pools
from baton.serve.runner.step_plan import StepPlan, TableSender, plan_chunks
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.block_manager import BlockManager
from baton.serve.scheduling.window_blocks import NULL_BLOCK, WindowBlocks

BS, WINDOW = 4, 8


class Driver:
    """A block manager with both groups and the tables sent to a worker: each step's plan, as the
    worker rebuilds it from the pickled wire, must be the driver's own."""

    def __init__(self) -> None:
        self.bm = BlockManager(96, BS, True, num_host_blocks=64, window=WindowBlocks(40, BS, WINDOW, 40))
        self.sender, self.receiver = GroupTableSender(), GroupTableReceiver()

    def step(self, scheduled: list[tuple[Sequence, int]]):
        for seq, n in scheduled:
            assert self.bm.allocate_slots(seq, n)
        self.bm.take_pending()
        chunks, _ = plan_chunks(scheduled)
        want = StepPlan.from_chunks(chunks, BS)
        assert want.window is not None
        wire = pickle.loads(pickle.dumps(self.sender.encode(chunks, False, True, False)))
        assert self.receiver.decode(wire, BS) == want
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            self.bm.register_full_blocks(seq)  # the sliding group frees what left the window
        return wire

    def free(self, seq: Sequence) -> None:
        self.bm.free(seq)
        self.sender.release(seq.seq_id)


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(tokens), SamplingParams())


def test_workers_rebuild_both_groups_tables_through_every_change():
    rng = random.Random(0)
    d = Driver()
    shared = [rng.randrange(500) for _ in range(24)]
    seqs = [_seq(i, [rng.randrange(500) for _ in range(n)]) for i, n in enumerate((3, 21, 9))] + [_seq(3, shared)]
    d.step([(s, s.num_tokens) for s in seqs])  # prefill: whole tables go out
    swapped, dropped_before = None, d.bm.window.num_dropped
    for step in range(40):
        event = step in (2, 5, 9, 14, 20)
        if step == 5:  # preempted by swap: both groups' blocks go to the host and come back elsewhere
            swapped = seqs.pop(0)
            d.bm.swap_out(swapped)
        if step == 9:
            d.bm.swap_in(swapped)
            seqs.append(swapped)
        if step == 14:  # preempted by recompute (the workers are not told): new tables, computed again
            s = seqs.pop(0)
            d.bm.free(s)
            s.num_computed_tokens = 0
            d.step([(s, s.num_tokens)])
            seqs.append(s)
        if step == 20:  # a fork shares both groups' blocks; its first write copies the shared one
            child = _seq(9, seqs[0].token_ids)
            child.num_computed_tokens = seqs[0].num_computed_tokens
            d.bm.fork(seqs[0], child)
            seqs.append(child)
        if step == 2:  # a prefix hit: the sliding group's table starts with NULLs before the window
            hit = _seq(10, shared + [1, 2, 3])
            assert d.bm.match_prefix(hit) == 24 and hit.window_block_table[0] == NULL_BLOCK
            hit.num_computed_tokens = 24
            d.step([(hit, 3)])
            seqs.append(hit)
        for s in seqs:
            s.token_ids.append(rng.randrange(500))
        wire = d.step([(s, 1) for s in seqs])
        if not event:  # at most one new block per sequence and group; entries leaving the window cost none
            assert sum(len(c.window_table) for c in wire.chunks) <= len(seqs)
            assert sum(len(c.block_table) for c in wire.chunks) <= len(seqs)
    assert d.bm.window.num_dropped > dropped_before + len(seqs)
    assert set(d.receiver.window_tables) == {s.seq_id for s in seqs}
    for s in seqs:
        d.free(s)
    new = _seq(11, [5, 6])
    d.step([(new, 2)])  # the released sequences are forgotten with the next step
    assert set(d.receiver.window_tables) == {11} and d.bm.problem([new]) is None


def test_a_long_decode_step_sends_no_sliding_table():
    """Long sequences decoding: their whole sliding tables (what TableSender alone would send) cost
    what the full tables would; the deltas cost a few bytes per sequence."""
    bm = BlockManager(2048, BS, False, window=WindowBlocks(2048, BS, WINDOW))
    seqs = [_seq(i, list(range(i, i + 800))) for i in range(8)]
    deltas, whole = GroupTableSender(), TableSender()
    for s in seqs:
        assert bm.allocate_slots(s, s.num_tokens)
    prefill, _ = plan_chunks([(s, s.num_tokens) for s in seqs])
    for sender in (deltas, whole):
        sender.encode(prefill, False, True, False)
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        bm.register_full_blocks(s)
        s.token_ids.append(7)
        assert bm.allocate_slots(s, 1)
    chunks, _ = plan_chunks([(s, 1) for s in seqs])
    assert all(c.window_table[:198] == [NULL_BLOCK] * 198 for c in chunks)  # the window: blocks 198-200
    delta, plain = (len(pickle.dumps(sender.encode(chunks, False, True, False))) for sender in (deltas, whole))
    assert delta < plain / 4, (delta, plain)


def test_ranks_agree_on_pools_that_fit_each():
    """Random ranks, some holding layers of one group only (a pipeline stage): the counts fit every
    rank's budget, the sliding pool is at most the demand and the full pool, and neither could be
    larger: one more full block, or one more sliding block with as many full ones, overflows a rank."""
    rng = random.Random(0)
    for _ in range(200):
        ranks = []
        for _ in range(rng.randint(1, 4)):
            full, window = rng.choice([(0, 1), (1, 0), (1, 1), (1, 5), (2, 3)])
            block = rng.choice([256, 1024])
            ranks.append((rng.randint(40, 400) * block, full * block, window * block))
        if not any(f for _, f, _ in ranks):
            ranks.append((100 * 1024, 1024, 0))
        demand = rng.randint(1, 200)
        n_full, n_window = group_split(ranks, demand)
        fits = lambda n, w: all(n * f + w * ws <= b for b, f, ws in ranks)  # noqa: E731
        assert fits(n_full, n_window) and 0 < n_window <= min(demand, n_full), (ranks, demand)
        assert not fits(n_full + 1, n_window), (ranks, demand)
        if n_window < demand:  # the sliding pool was cut to stay within the full pool
            assert not fits(n_window + 1, n_window + 1), (ranks, demand)


def test_agreed_pools_with_a_fixed_count_and_without_groups():
    kv = KVSizing(BS, "auto", 13, None, 0.1, 0.9, 4096, 16, 2, WINDOW)
    ranks = [(None, 256, 0), (None, 0, 256)]  # gpt-oss at P=2: stage 0 sliding only, stage 1 full only
    pools = agree_pools(kv, ranks)
    assert window_demand(BS, 2, 16, WINDOW) == 12  # 2 windows of 7 tokens at most 4 blocks each, 16 tokens
    assert (pools.num_blocks, pools.num_window_blocks) == (13, 12)
    assert (
        (pools.num_host_blocks, pools.num_window_host_blocks)
        == group_split([(4096, 256, 0), (4096, 0, 256)], 12)
        == (16, 12)
    )
    kv.window, kv.num_kv_blocks = None, None
    one = agree_pools(kv, [(10_000, 512, 0), (8_000, 256, 0)])
    assert (one.num_blocks, one.num_host_blocks, one.num_window_blocks) == (19, 8, 0)
