"""The block manager on its own: chained prefix hashes, LRU eviction of cached free blocks, and
exact ref-count accounting through abort, recompute and swap preemption, and copy-on-write forks.

Each test would fail on the classic bug it is named after (checked by breaking the code on purpose):
a block hash that ignores its parent, MRU instead of LRU eviction, a ref count leaked or dropped."""

from __future__ import annotations

from baton.serve.core.sequence import Sequence, SequenceStatus
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.block_manager import BlockManager, BlockOps
from baton.serve.scheduling.scheduler import Scheduler, SchedulerConfig

BS = 4  # tokens per block in every test here


def _seq(seq_id: int, tokens: list[int], arrival: float = 0.0) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, list(tokens), SamplingParams(), arrival_time=arrival)


def _prefill(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler and engine do for a new prompt, in one step: attach its cached prefix,
    allocate the rest, mark every token computed and register its full blocks. Returns the hit."""
    hit = bm.match_prefix(seq)
    seq.num_computed_tokens = hit
    assert bm.allocate_slots(seq, seq.num_tokens - hit)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    return hit


def _state(bm: BlockManager) -> tuple[int, list[int], int]:
    """Everything a leak would show in: free device blocks, each block's ref count, free host blocks."""
    return bm.num_free_blocks, [b.ref_count for b in bm.blocks], len(bm.host_free)


def _refs_of(*seqs: Sequence, num_blocks: int) -> list[int]:
    """The ref counts the block tables of `seqs` imply, counted independently of the manager."""
    refs = [0] * num_blocks
    for s in seqs:
        for b in s.block_table:
            refs[b] += 1
    return refs


# ----------------------------------------------------------------------------------- prefix hashes
X, Y, Z, W = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
TAIL = [99]  # one more token: the cache always leaves the last prompt token to compute


def test_block_hash_chains_its_parent():
    """X+W may reuse X's block from X+Y, but not W's block from Z+W: W after Z is other KV than W after X."""
    bm = BlockManager(16, BS)
    xy, zw = _seq(0, X + Y + TAIL), _seq(1, Z + W + TAIL)
    assert _prefill(bm, xy) == 0 and _prefill(bm, zw) == 0
    xw = _seq(2, X + W + TAIL)
    assert _prefill(bm, xw) == BS, "only X's block is a valid prefix hit"
    assert xw.block_table[0] == xy.block_table[0]
    assert xw.block_table[1] not in zw.block_table + xy.block_table, "W's KV after Z was reused after X"
    assert bm.blocks[zw.block_table[1]].ref_count == 1
    # Control: the same two blocks in the same order are one prefix, shared whole.
    zw2 = _seq(3, Z + W + [98])
    assert _prefill(bm, zw2) == 2 * BS and zw2.block_table[:2] == zw.block_table[:2]
    assert [bm.blocks[b].ref_count for b in zw.block_table[:2]] == [2, 2]


# ----------------------------------------------------------------------------------- LRU eviction
def test_cached_free_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(4, BS)
    a, b, c = _seq(0, [1, 2, 3, 4]), _seq(1, [5, 6, 7, 8]), _seq(2, [9, 10, 11, 12])
    for s in (a, b, c):
        _prefill(bm, s)
    hashes = {name: s.block_hashes[0] for name, s in (("a", a), ("b", b), ("c", c))}
    ids = {name: s.block_table[0] for name, s in (("a", a), ("b", b), ("c", c))}
    for s in (c, a, b):  # last use: c, then a, then b
        bm.free(s)
    assert set(bm.cached) == set(hashes.values()), "freed blocks stay in the prefix cache"
    # a is used again (a prefix hit) and freed: now the most recently used.
    probe = _seq(3, [1, 2, 3, 4, 50])
    assert _prefill(bm, probe) == BS and probe.block_table[0] == ids["a"]
    bm.free(probe)
    # LRU order is now c, b, a. Two uncached blocks' worth of new tokens must evict c, then b.
    new = _seq(4, [60, 61, 62, 63, 64, 65, 66, 67])
    assert _prefill(bm, new) == 0
    assert new.block_table == [ids["c"], ids["b"]], "not the least recently used blocks"
    assert hashes["c"] not in bm.cached and hashes["b"] not in bm.cached
    assert bm.cached.get(hashes["a"]) == ids["a"], "the most recently used cached block was evicted"
    bm.free(new)
    again = _seq(5, [1, 2, 3, 4, 70])
    assert _prefill(bm, again) == BS, "the recently used block is still a prefix-cache hit"
    assert _prefill(bm, _seq(6, [9, 10, 11, 12, 70])) == 0


# ----------------------------------------------------------------------------------- ref counts
def test_abort_mid_flight_returns_every_block():
    """Shared prefixes (ref count 2) and a partial prefill, aborted: all blocks free, all counts 0."""
    bm = BlockManager(32, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10), bm)
    start = _state(bm)
    shared = list(range(1, 13))  # three full blocks
    seqs = [_seq(i, shared + [100 + i] * (3 + 4 * i), arrival=float(i)) for i in range(3)]
    sched.add(seqs[0])
    for _ in range(3):  # the first prompt's prefill, chunked, then a decode
        for s, n in sched.schedule().scheduled:
            s.num_computed_tokens += n
            bm.register_full_blocks(s)
    for s in seqs[1:]:
        sched.add(s)
    for s, n in sched.schedule().scheduled:
        s.num_computed_tokens += n
        bm.register_full_blocks(s)
    assert max(b.ref_count for b in bm.blocks) >= 2, "the shared prefix should be one set of blocks"
    assert seqs[2].num_computed_tokens < seqs[2].num_tokens or seqs[2] in sched.waiting, "meant to abort mid-prefill"
    assert _state(bm)[1] == _refs_of(*seqs, num_blocks=bm.num_blocks)
    for s in seqs:
        sched.finish(s)
    assert _state(bm) == start and not sched.has_work()


def _grow_to_preemption(bm: BlockManager, mode: str) -> tuple[Scheduler, Sequence, Sequence, list[int], BlockOps]:
    """Two 7-token sequences in 4 blocks of 4, each then needing a third block: the newer is
    preempted. Returns the scheduler, the survivor, the victim, the victim's blocks before and
    the block ops of the step that preempted it."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, preemption_mode=mode), bm)
    a, b = _seq(0, list(range(1, 8)), arrival=0.0), _seq(1, list(range(11, 18)), arrival=1.0)
    sched.add(a)
    sched.add(b)
    assert [s.seq_id for s, _ in sched.schedule().scheduled] == [0, 1]
    for s in (a, b):
        s.num_computed_tokens = 7
        bm.register_full_blocks(s)
        s.token_ids += [5, 5]
    victim_blocks = list(b.block_table)
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == [1] and [s.seq_id for s, _ in out.scheduled] == [0]
    return sched, a, b, victim_blocks, out.block_ops


def test_recompute_preemption_releases_the_victims_blocks_exactly():
    bm = BlockManager(4, BS)
    start = _state(bm)
    sched, a, b, _, _ = _grow_to_preemption(bm, "recompute")
    assert b.status == SequenceStatus.WAITING and not b.block_table and b.num_computed_tokens == 0
    assert _state(bm) == (4 - len(a.block_table), _refs_of(a, num_blocks=4), 0)
    sched.finish(a)
    # The victim comes back (its first block from the prefix cache) and then finishes too.
    assert [s.seq_id for s, _ in sched.schedule().scheduled] == [1] and b.num_computed_tokens == BS
    assert _state(bm)[1] == _refs_of(b, num_blocks=4)
    sched.finish(b)
    assert _state(bm) == start


def test_swap_preemption_moves_blocks_to_the_host_and_back():
    bm = BlockManager(4, BS, num_host_blocks=4)
    start = _state(bm)
    assert start == (4, [0] * 4, 4)
    sched, a, b, victim_blocks, ops = _grow_to_preemption(bm, "swap")
    # Really swapped: the victim's KV is queued for copy-out into host blocks it now owns.
    assert b.status == SequenceStatus.SWAPPED and b in sched.swapped and not b.block_table
    assert len(b.host_block_table) == len(victim_blocks) == 2
    assert ops.swap_out == list(zip(victim_blocks, b.host_block_table))
    assert len(bm.host_free) == 2 and not set(b.host_block_table) & set(bm.host_free)
    assert _state(bm)[:2] == (4 - len(a.block_table), _refs_of(a, num_blocks=4))
    swap_out, swap_in = ops.swap_out, ops.swap_in
    assert swap_out and not swap_in
    hosts = list(b.host_block_table)
    sched.finish(a)
    out = sched.schedule()  # room again: the victim is swapped back in, before anything new
    assert [s.seq_id for s, _ in out.scheduled] == [1] and b.status == SequenceStatus.RUNNING
    assert not b.host_block_table and len(bm.host_free) == 4
    assert [h for h, _ in out.block_ops.swap_in] == hosts, "each host block copied back, in order"
    assert [d for _, d in out.block_ops.swap_in] == b.block_table[:2]
    assert b.num_computed_tokens == 7, "swapped KV is kept, not recomputed"
    assert _state(bm)[1] == _refs_of(b, num_blocks=4)
    sched.finish(b)
    assert _state(bm) == start


def test_swap_out_and_in_directly_keep_the_host_pool_exact():
    bm = BlockManager(8, BS, num_host_blocks=3)
    start = _state(bm)
    seq = _seq(0, list(range(1, 11)))  # 3 blocks, the last partial
    _prefill(bm, seq)
    device = list(seq.block_table)
    assert bm.can_swap_out(seq)
    bm.swap_out(seq)
    assert bm.pending_swap_out == list(zip(device, seq.host_block_table)) and len(set(seq.host_block_table)) == 3
    assert bm.host_free == [] and not seq.block_table and bm.num_free_blocks == 8
    other = _seq(1, [1, 2])
    _prefill(bm, other)
    assert not bm.can_swap_out(other), "the host pool is full"
    bm.free(other)
    assert bm.can_swap_in(seq, 1)
    hosts = list(seq.host_block_table)
    bm.swap_in(seq)
    assert [h for h, _ in bm.pending_swap_in] == hosts and [d for _, d in bm.pending_swap_in] == seq.block_table
    assert sorted(bm.host_free) == [0, 1, 2] and seq.host_block_table == []
    assert _state(bm)[1] == _refs_of(seq, num_blocks=8)
    ops = bm.take_pending()
    assert (len(ops.swap_out), len(ops.swap_in), ops.copies) == (3, 3, [])
    assert bm.take_pending() == BlockOps()
    bm.free(seq)
    assert _state(bm) == start


def test_fork_copies_only_the_shared_partial_block_and_frees_cleanly():
    bm = BlockManager(8, BS)
    start = _state(bm)
    parent = _seq(0, list(range(1, 7)))  # one full block and a partial one
    _prefill(bm, parent)
    child = _seq(1, list(parent.token_ids))
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [2, 2]
    free_before = bm.num_free_blocks
    for s, tok in ((parent, 7), (child, 8)):  # both write their next token into the shared partial block
        s.token_ids.append(tok)
        assert bm.allocate_slots(s, 1)
    assert len(bm.pending_copies) == 1, "only the first writer copies; the last owner writes in place"
    src, dst = bm.pending_copies[0]
    assert src == child.block_table[1] and dst == parent.block_table[1] and src != dst
    assert parent.block_table[0] == child.block_table[0], "full blocks stay shared"
    assert bm.num_free_blocks == free_before - 1
    assert _state(bm)[1] == _refs_of(parent, child, num_blocks=8)
    bm.take_pending()
    bm.free(child)
    assert _state(bm)[1] == _refs_of(parent, num_blocks=8)
    bm.free(parent)
    assert _state(bm) == start
