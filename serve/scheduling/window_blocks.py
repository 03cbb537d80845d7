"""The sliding-window layers' KV group: blocks of their own, freed once they fall out of the window.

A model that mixes sliding-window and full-attention layers (Gemma 2/3, gpt-oss, Qwen3 with
layer_types) has two KV groups (vLLM's hybrid KV cache manager): the full layers keep every token
in the BlockManager's blocks (`Sequence.block_table`), the sliding layers keep theirs in a pool of
their own, with a table per sequence (`Sequence.window_block_table`) over the same logical blocks.
A query at position p sees keys p - window + 1 .. p, so once a sequence's next token is at p, its
blocks wholly before p - window + 1 are never read again: they go back to the pool (keeping their
prefix hash: still findable until evicted) and their table entries become NULL_BLOCK. The paged
attention kernels skip keys before the window (the C++ and Triton ones start there; the torch paths
read the block and mask it), and a pool holds finite values only, so a placeholder never changes a
result. A sequence thus holds at most ceil((window - 1 + chunk) / block) + 1 blocks of this group
however long it runs: Gemma 3's five sliding layers in six cost a long context about what its one
full layer in six does (docs/benchmarks.md, "KV bytes per token by family").

Prefix caching works across both groups: both register a computed block under the same chained
hash, and a hit of k blocks needs the full group's blocks 0..k-1 and this group's blocks from the
first the token after the hit still sees up to k-1 (`usable_hit` shortens a hit to the longest k
that has them). Forks share this group's blocks as they share the full group's (copy-on-write);
swapping moves the held blocks to a host pool of this group and back, NULL entries staying NULL.

The BlockManager calls this group at each of its own operations, as it calls StateSlots for a
Mamba hybrid's recurrent states; the model runner gives the sliding layers' pools this group's
size and their own slot mapping and block tables (serve/runner/step_plan.py's WindowPlan).
"""

from __future__ import annotations

from baton.serve.core.sequence import Sequence
from baton.serve.scheduling.block_pool import BlockPool

NULL_BLOCK = 0  # an out-of-window entry: any block id would do (never read unmasked); 0 as the tables' padding
HOST_NULL = -1  # the same entry in a swapped sequence's host table


def window_blocks_bound(window: int, block_size: int, chunk: int) -> int:
    """The most blocks of this group one sequence holds while computing `chunk` new tokens: the
    window before the chunk's first token, the chunk, and a partial block at either end."""
    return -(-(window - 1 + chunk) // block_size) + 1


class WindowBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int, num_host_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError("the sliding-window KV group needs at least one block")
        self.pool = BlockPool(num_blocks, num_host_blocks)
        self.block_size, self.window = block_size, window
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_swap_out: list[tuple[int, int]] = []
        self.pending_swap_in: list[tuple[int, int]] = []
        self.num_dropped = 0  # blocks freed for leaving the window, in all so far

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free_blocks)

    @property
    def num_host_blocks(self) -> int:
        return self.pool.num_host_blocks

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` (or any later one) still reads."""
        return max(0, position - self.window + 1) // self.block_size

    @staticmethod
    def held(seq: Sequence) -> list[int]:
        """The blocks of this group the sequence holds (its table less the NULL entries)."""
        table = seq.window_block_table or []
        return table[seq.num_window_dropped :]

    # --------------------------------------------------------------------------- prefix cache
    def usable_hit(self, hashes: list[bytes], k: int) -> int:
        """The longest hit k' <= k (in blocks) whose window is cached here too: the blocks from the
        first that the token at k' * block_size sees up to k' - 1."""
        cached, run, runs = self.pool.cached, 0, []
        for i in range(k):
            run = run + 1 if hashes[i] in cached else 0
            runs.append(run)
        for j in range(k, 0, -1):
            if runs[j - 1] >= j - self.first_needed_block(j * self.block_size):
                return j
        return 0

    def attach_hit(self, seq: Sequence, k: int) -> None:
        """A new sequence's first k blocks come from the cache (usable_hit said they can)."""
        first = self.first_needed_block(k * self.block_size)
        hits = [self.pool.cached[h] for h in seq.block_hashes[first:k]]
        for block_id in hits:
            self.pool.ref(block_id)
        seq.window_block_table = [NULL_BLOCK] * first + hits
        seq.num_window_dropped = first

    def register(self, seq: Sequence, start: int, end: int) -> None:
        """Offer blocks start..end-1 (full and computed) to the prefix cache, as the full group does."""
        table = seq.window_block_table or []
        for i in range(max(start, seq.num_window_dropped), min(end, len(table))):
            self.pool.register(table[i], seq.block_hashes[i])

    # --------------------------------------------------------------------------- allocation
    def drop(self, seq: Sequence) -> None:
        """Free the blocks wholly before the window of the sequence's next token."""
        table = seq.window_block_table
        if not table:
            return
        first = min(self.first_needed_block(seq.num_computed_tokens), len(table))
        for i in range(seq.num_window_dropped, first):
            self.pool.unref(table[i])
            table[i] = NULL_BLOCK
            self.num_dropped += 1
        seq.num_window_dropped = max(seq.num_window_dropped, first)

    def _needs_cow(self, seq: Sequence) -> bool:
        cached = seq.num_computed_tokens
        if cached % self.block_size == 0 or not seq.window_block_table:
            return False
        return self.pool.blocks[seq.window_block_table[cached // self.block_size]].ref_count > 1

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks for num_new_tokens more tokens (after `drop`)."""
        total = seq.num_computed_tokens + num_new_tokens
        need = -(-total // self.block_size) - len(seq.window_block_table or [])
        return max(0, need) + (1 if self._needs_cow(seq) else 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Room for num_new_tokens more tokens (can_allocate said there is)."""
        if seq.window_block_table is None:
            seq.window_block_table = []
        table = seq.window_block_table
        if self._needs_cow(seq):
            idx = seq.num_computed_tokens // self.block_size
            old, new = table[idx], self.pool.pop_free()
            self.pending_copies.append((old, new))
            self.pool.unref(old)
            table[idx] = new
        total = seq.num_computed_tokens + num_new_tokens
        while len(table) * self.block_size < total:
            table.append(self.pool.pop_free())

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(self.held(seq)):  # tail first, as the full group
            self.pool.unref(block_id)
        seq.window_block_table = None
        seq.num_window_dropped = 0

    def trim(self, seq: Sequence, keep: int) -> None:
        """Free the entries past the first `keep` (the slots of rejected speculative tokens)."""
        table = seq.window_block_table or []
        for block_id in reversed(table[max(keep, seq.num_window_dropped) :]):
            self.pool.unref(block_id)
        del table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.window_block_table = None if parent.window_block_table is None else list(parent.window_block_table)
        child.num_window_dropped = parent.num_window_dropped
        for block_id in self.held(child):
            self.pool.blocks[block_id].ref_count += 1

    # --------------------------------------------------------------------------- swapping
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self.pool.host_free) >= len(self.held(seq))

    def swap_out(self, seq: Sequence) -> None:
        """Queue the held blocks' copies to the host pool (the BlockManager frees them next)."""
        host = [HOST_NULL] * seq.num_window_dropped
        for block_id in self.held(seq):
            h = self.pool.host_free.pop()
            self.pending_swap_out.append((block_id, h))
            host.append(h)
        seq.window_host_block_table = host

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for its swapped blocks, and then for the new tokens after those out of the window go."""
        host = seq.window_host_block_table
        real = sum(h != HOST_NULL for h in host)
        dropped = len(host) - real
        leaving = max(0, min(self.first_needed_block(seq.num_computed_tokens), len(host)) - dropped)
        new = max(0, -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(host))
        return max(real, real - leaving + new) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> None:
        table = []
        for h in seq.window_host_block_table:
            if h == HOST_NULL:
                table.append(NULL_BLOCK)
                continue
            block_id = self.pool.pop_free()
            self.pending_swap_in.append((h, block_id))
            table.append(block_id)
            self.pool.host_free.append(h)
        seq.window_block_table = table
        seq.num_window_dropped = sum(h == HOST_NULL for h in seq.window_host_block_table)
        seq.window_host_block_table = []

    def free_host(self, seq: Sequence) -> None:
        self.pool.host_free.extend(h for h in seq.window_host_block_table if h != HOST_NULL)
        seq.window_host_block_table = []

    def take_pending(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap-outs, swap-ins, copies) queued since the last call."""
        out = (self.pending_swap_out, self.pending_swap_in, self.pending_copies)
        self.pending_swap_out, self.pending_swap_in, self.pending_copies = [], [], []
        return out

    def problem(self, live: list[Sequence]) -> str | None:
        held = [b for s in live for b in self.held(s)]
        held_host = [h for s in live for h in s.window_host_block_table if h != HOST_NULL]
        return self.pool.problem(held, held_host, "sliding-window KV")
