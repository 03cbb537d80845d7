"""Dropping KV the model will never attend to again: StreamingLLM and sliding windows.

StreamingLLM (Xiao et al., 2023) keeps the first few "attention sink" tokens and a window of
recent tokens, evicting the middle, so one stream runs far past the trained context at constant
memory. As in the paper, positions are positions *within the cache*: when a block is evicted,
every later key moves `block_size` places to the left. Rather than caching keys before RoPE, we
rotate the surviving cached keys by -block_size positions (RoPE rotations compose), which gives
the same keys the paper's re-rotation would.

Sliding-window models (Mistral) only ever look `window` tokens back, so blocks wholly older than
that are freed; their positions stay absolute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from baton.serve.core.sequence import Sequence
from baton.serve.scheduling.block_manager import BlockManager


class EvictionPolicy(Protocol):
    positions_in_cache: bool  # True: RoPE positions are cache indices (StreamingLLM)

    def evict(self, seq: Sequence, bm: BlockManager) -> None: ...

    def take_rerotations(self) -> list[tuple[list[int], int]]:
        """(block ids, positions to shift their cached keys left) queued by evict() since the last call."""

    def cached_bound(self, num_prompt: int, block_size: int, chunked_prefill: bool) -> int | None:
        """The most tokens one sequence ever holds in the cache (admission sizes it by this), or None:
        no bound beyond the model's context."""


@dataclass
class StreamingLLMPolicy:
    num_sink_tokens: int = 4
    window_tokens: int = 1024
    positions_in_cache: bool = True
    pending_rerotations: list[tuple[list[int], int]] = field(default_factory=list)  # see take_rerotations

    def evict(self, seq: Sequence, bm: BlockManager) -> None:
        bs = bm.block_size
        sink_blocks = -(-self.num_sink_tokens // bs)
        in_cache = seq.num_computed_tokens - seq.num_evicted_tokens
        excess = in_cache + 1 - sink_blocks * bs - self.window_tokens  # counting the next token
        n = excess // bs
        if n <= 0 or in_cache < (sink_blocks + n) * bs:
            return
        bm.drop_leading_blocks(seq, sink_blocks, n)
        survivors = seq.block_table[sink_blocks:]
        if survivors:
            self.pending_rerotations.append((list(survivors), n * bs))

    def take_rerotations(self) -> list[tuple[list[int], int]]:
        out, self.pending_rerotations = self.pending_rerotations, []
        return out

    def cached_bound(self, num_prompt: int, block_size: int, chunked_prefill: bool) -> int | None:
        """Evicted down to sinks + window + a part block (+ the token computed); without chunked
        prefill a longer prompt is cached whole first (with it, it is chunked: Scheduler._chunk)."""
        sinks = -(-self.num_sink_tokens // block_size) * block_size
        bound = sinks + self.window_tokens + block_size - 1
        return bound if chunked_prefill else max(bound, num_prompt)


@dataclass
class SlidingWindowPolicy:
    window: int
    positions_in_cache: bool = False

    def evict(self, seq: Sequence, bm: BlockManager) -> None:
        # The next query sits at num_computed_tokens and sees keys from here on:
        first_needed = seq.num_computed_tokens - self.window + 1
        n = (first_needed - seq.num_evicted_tokens) // bm.block_size
        if n > 0:
            bm.drop_leading_blocks(seq, 0, n)

    def take_rerotations(self) -> list[tuple[list[int], int]]:
        return []  # positions stay absolute: nothing moves

    def cached_bound(self, num_prompt: int, block_size: int, chunked_prefill: bool) -> int | None:
        return None  # freed blocks are reused, but the positions (and the context) run on
