"""PagedAttention's block manager: KV memory as fixed-size blocks, with automatic prefix caching.

Each sequence owns a block table (logical block i -> physical block id). Blocks are reference
counted so that forked samples (n > 1) share their prompt; a shared, partly filled block is copied
before it is written (copy-on-write). A full block is identified by a hash chained over its tokens
and its parent's hash, so two requests with the same prefix share the same physical blocks. Freed
blocks keep their hash and stay findable until they are evicted, least recently used first.

A hybrid model's mixers keep a recurrent state per sequence instead of blocks: `states`
(serve/scheduling/state_slots.py's StateSlots) follows every sequence's blocks here - taken with its first
blocks, freed, forked, swapped with them - and a prefix hit needs the state snapshot where the
hit ends, so hits are cut back to the longest cached prefix that has one.

A model that mixes sliding-window and full layers has a second KV group, `window`
(serve/scheduling/window_blocks.py's WindowBlocks): the blocks here are the full layers', and the
sliding layers keep their own, freed as they leave the window; every operation here does its part
for that group too, and a prefix hit is cut back to where both groups have the blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from baton.serve.core.sequence import Sequence
from baton.serve.scheduling.block_pool import Block, BlockPool
from baton.serve.scheduling.state_slots import StateOp, StateSlots
from baton.serve.scheduling.window_blocks import WindowBlocks

__all__ = ["Block", "BlockManager", "BlockOps", "hash_block"]


@dataclass
class BlockOps:
    """KV work a step needs before its forward, in the order the model runner applies it."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    rerotations: list[tuple[list[int], int]] = field(default_factory=list)  # StreamingLLM: (blocks, shift left)
    state_ops: list[StateOp] = field(default_factory=list)  # hybrid: state slot copies/swaps, in order
    window: BlockOps | None = None  # KV groups: the sliding-window layers' swaps and copies (their own block ids)


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """Chained block hash: equal hashes mean equal full token prefixes (blake2b, 128 bits)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        states: StateSlots | None = None,
        window: WindowBlocks | None = None,
    ):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        if states is not None and window is not None:
            raise ValueError("a model with recurrent-state slots has no sliding-window KV group")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, num_host_blocks, states.evict if states is not None else None)
        # the pool's own containers, by the names they had here
        self.blocks, self.free_blocks, self.cached = self.pool.blocks, self.pool.free_blocks, self.pool.cached
        self.host_free, self.num_host_blocks = self.pool.host_free, num_host_blocks
        # Work for the model runner, drained every step: (src, dst) block copies.
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_swap_out: list[tuple[int, int]] = []  # (device block, host block)
        self.pending_swap_in: list[tuple[int, int]] = []  # (host block, device block)
        self.states = states
        self.window = window
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0

    # --------------------------------------------------------------------------- accounting
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def _pop_free(self) -> int:
        return self.pool.pop_free()

    def _ref(self, block_id: int) -> None:
        self.pool.ref(block_id)

    def _unref(self, block_id: int) -> None:
        self.pool.unref(block_id)

    # --------------------------------------------------------------------------- prefix cache
    def update_hashes(self, seq: Sequence) -> None:
        bs = self.block_size
        while len(seq.block_hashes) < seq.num_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a new sequence; returns the
        number of tokens whose KV is thereby already computed (always leaves one to compute)."""
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        self.update_hashes(seq)
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.cached.get(seq.block_hashes[i])
            if block_id is None:
                break
            hits.append(block_id)
        if self.states is not None:  # the recurrent state must be restorable where the hit ends
            kv_hit = len(hits)
            while hits and not self.states.has_snapshot(seq.block_hashes[len(hits) - 1]):
                hits.pop()
            if len(hits) < kv_hit:  # prompts part here: worth a snapshot when this one gets there
                self.states.diverged[seq.seq_id] = kv_hit * self.block_size
            if hits:
                self.states.plan_restore(seq, seq.block_hashes[len(hits) - 1])
        if self.window is not None:  # the sliding layers' blocks in the window before the hit's end too
            del hits[self.window.usable_hit(seq.block_hashes, len(hits)) :]
            self.window.attach_hit(seq, len(hits))
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = hits
        seq.num_registered_blocks = len(hits)
        return len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed, computed blocks to the prefix cache (after a
        step's forward; then the sliding-window group frees what the next token no longer sees)."""
        if self.enable_prefix_caching:
            self.update_hashes(seq)
            full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
            for i in range(seq.num_registered_blocks, full):
                self.pool.register(seq.block_table[i], seq.block_hashes[i])
            if self.window is not None:
                self.window.register(seq, seq.num_registered_blocks, full)
            seq.num_registered_blocks = max(seq.num_registered_blocks, full)
            if self.states is not None:
                self.states.publish(seq)
        if self.window is not None:
            self.window.drop(seq)

    # --------------------------------------------------------------------------- allocation
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens - seq.num_evicted_tokens + num_new_tokens
        need = -(-total // self.block_size) - len(seq.block_table)
        return max(0, need) + (1 if self._needs_cow(seq) else 0)

    def _needs_cow(self, seq: Sequence) -> bool:
        cached = seq.num_computed_tokens - seq.num_evicted_tokens
        if cached % self.block_size == 0:
            return False
        block_id = seq.block_table[cached // self.block_size]
        return self.blocks[block_id].ref_count > 1

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of KV; False (and no change) if it can't (but
        the sliding-window group's blocks that left the window are freed either way)."""
        if self.window is not None:
            self.window.drop(seq)
            if not self.window.can_allocate(seq, num_new_tokens):
                return False
        if not self.can_allocate(seq, num_new_tokens) or (self.states is not None and not self.states.can_take(seq)):
            return False
        if self.states is not None:
            self.states.take(seq)
            self._plan_snapshot(seq, num_new_tokens)
        if self._needs_cow(seq):
            idx = (seq.num_computed_tokens - seq.num_evicted_tokens) // self.block_size
            old = seq.block_table[idx]
            new = self._pop_free()
            self.pending_copies.append((old, new))
            self._unref(old)
            seq.block_table[idx] = new
        total = seq.num_computed_tokens - seq.num_evicted_tokens + num_new_tokens
        while len(seq.block_table) * self.block_size < total:
            seq.block_table.append(self._pop_free())
        if self.window is not None:
            self.window.allocate(seq, num_new_tokens)
        return True

    def _plan_snapshot(self, seq: Sequence, num_new_tokens: int) -> None:
        """Block boundaries in this prompt chunk where the state is kept, so that a later request
        with that prefix can start there: where the same prompt's hit would end (its last block
        boundary before the final token), where the chunk's last full block ends (long prompts),
        and where an earlier request's KV blocks matched this prompt but no state did (a shared
        prefix seen twice)."""
        if not self.enable_prefix_caching:
            return
        bs, start, prompt = self.block_size, seq.num_computed_tokens, seq.num_prompt_tokens
        end = min(start + num_new_tokens, prompt)
        wanted = {(prompt - 1) // bs * bs, end // bs * bs, self.states.diverged.get(seq.seq_id, 0)}
        self.update_hashes(seq)
        for p in sorted(p for p in wanted if start < p <= end):
            self.states.plan_snapshot(seq, p, seq.block_hashes[p // bs - 1])
            if p == self.states.diverged.get(seq.seq_id):
                del self.states.diverged[seq.seq_id]

    def free(self, seq: Sequence) -> None:
        if self.states is not None:
            self.states.release(seq)
        if self.window is not None:
            self.window.free(seq)
        # Tail first, so a prompt's head blocks are the last to be evicted from the cache.
        for block_id in reversed(seq.block_table):
            if block_id >= 0:
                self._unref(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Free blocks past the computed tokens (slots of rejected speculative tokens)."""
        keep = -(-(seq.num_computed_tokens - seq.num_evicted_tokens) // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._unref(block_id)
        del seq.block_table[keep:]
        if self.window is not None:
            self.window.trim(seq, keep)
        seq.num_registered_blocks = min(seq.num_registered_blocks, keep)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks; whoever writes a shared block first copies it."""
        child.block_table = list(parent.block_table)
        child.num_registered_blocks = parent.num_registered_blocks
        child.block_hashes = list(parent.block_hashes)
        for block_id in child.block_table:
            if block_id >= 0:
                self.blocks[block_id].ref_count += 1
        if self.states is not None:
            self.states.fork(parent, child)
        if self.window is not None:
            self.window.fork(parent, child)

    def drop_leading_blocks(self, seq: Sequence, start: int, count: int) -> None:
        """Free `count` blocks after the first `start` ones (StreamingLLM / sliding window)."""
        for block_id in seq.block_table[start : start + count]:
            self._unref(block_id)
        del seq.block_table[start : start + count]
        seq.num_evicted_tokens += count * self.block_size

    # --------------------------------------------------------------------------- swapping
    def can_swap_out(self, seq: Sequence) -> bool:
        return (
            len(self.host_free) >= len(seq.block_table)
            and (self.states is None or self.states.can_swap_out())
            and (self.window is None or self.window.can_swap_out(seq))
        )

    def swap_out(self, seq: Sequence) -> None:
        if self.states is not None:
            self.states.swap_out(seq)
        if self.window is not None:
            self.window.swap_out(seq)
        for block_id in seq.block_table:
            host = self.host_free.pop()
            self.pending_swap_out.append((block_id, host))
            seq.host_block_table.append(host)
        self.free(seq)

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for its swapped blocks plus the new tokens it will compute right away."""
        total = seq.num_computed_tokens - seq.num_evicted_tokens + num_new_tokens
        fits = max(len(seq.host_block_table), -(-total // self.block_size)) <= self.num_free_blocks
        if self.window is not None and not self.window.can_swap_in(seq, num_new_tokens):
            return False
        return fits and (self.states is None or self.states.num_free > 0)

    def swap_in(self, seq: Sequence) -> None:
        if self.states is not None:
            self.states.swap_in(seq)
        if self.window is not None:
            self.window.swap_in(seq)
        for host in seq.host_block_table:
            block_id = self._pop_free()
            self.pending_swap_in.append((host, block_id))
            seq.block_table.append(block_id)
            self.host_free.append(host)
        seq.host_block_table = []

    def free_host(self, seq: Sequence) -> None:
        self.host_free.extend(seq.host_block_table)
        seq.host_block_table = []
        if self.states is not None:
            self.states.free_host(seq)
        if self.window is not None:
            self.window.free_host(seq)

    def take_pending(self) -> BlockOps:
        """The swaps and copies queued since the last call (no rerotations: those are the eviction policy's)."""
        out = BlockOps(self.pending_swap_out, self.pending_swap_in, self.pending_copies)
        if self.states is not None:
            out.state_ops = self.states.take_ops()
        if self.window is not None:
            out.window = BlockOps(*self.window.take_pending())
        self.pending_swap_out, self.pending_swap_in, self.pending_copies = [], [], []
        return out

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def problem(self, live: Iterable[Sequence]) -> str | None:
        """None if every block's ref count equals the live block tables holding it, the free list is
        exactly the unreferenced blocks, the host pool's free and held blocks add up, and a hybrid's
        state slots (or the sliding-window group's blocks) add up too; else why not (the engine
        recounts after failing requests: serve/core/faults.py)."""
        live = list(live)
        held = [b for s in live for b in s.block_table if b >= 0]
        problem = self.pool.problem(held, [h for s in live for h in s.host_block_table])
        if problem is None and self.window is not None:
            problem = self.window.problem(live)
        if problem is None and self.states is not None:
            problem = self.states.problem(live)
        return problem
