"""One group's physical KV blocks: ref counts, the free list, the prefix cache and the host swap blocks.

A block is free when no sequence holds it (ref count 0). The free list is ordered least recently
freed first, and that is the order blocks are handed out again: a freed block keeps its prefix
hash and stays findable in the cache until it is handed out (evicted), so the blocks freed last -
a prompt's head, freed tail first - are evicted last. The BlockManager (serve/scheduling/block_manager.py) keeps
one pool for the layers that see the whole context; a model that mixes sliding-window and full
layers has a second one for its sliding layers (serve/scheduling/window_blocks.py).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is registered in the prefix cache


class BlockPool:
    def __init__(self, num_blocks: int, num_host_blocks: int = 0, on_evict: Callable[[bytes], None] | None = None):
        """`on_evict(hash)`: called when a cached block is handed out again (its prefix is gone)."""
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[bytes, int] = {}
        self.host_free: list[int] = list(range(num_host_blocks))[::-1]
        self.num_host_blocks = num_host_blocks
        self.on_evict = on_evict

    def pop_free(self) -> int:
        """The least recently freed block, out of the cache and held once."""
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.on_evict is not None:
                    self.on_evict(block.hash)
            block.hash = None
        block.ref_count = 1
        return block_id

    def ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None  # most recently used: evicted last

    def register(self, block_id: int, h: bytes) -> None:
        """Offer a full, computed block to the prefix cache under its chained hash (the first block
        with a hash keeps it)."""
        block = self.blocks[block_id]
        if block.hash is None and h not in self.cached:
            block.hash = h
            self.cached[h] = block_id

    def problem(self, held: list[int], held_host: list[int], what: str = "KV") -> str | None:
        """None if every block's ref count equals how often `held` (the live tables' entries) names
        it, the free list is exactly the unreferenced blocks, and the host pool's free blocks and
        `held_host` add up; else why not."""
        refs = Counter(held)
        wrong = [b.block_id for b in self.blocks if b.ref_count != refs.get(b.block_id, 0)]
        if wrong:
            b = self.blocks[wrong[0]]
            return (
                f"{what} block {b.block_id} has ref count {b.ref_count} but {refs.get(b.block_id, 0)} live sequences "
                f"hold it ({len(wrong)} blocks disagree)"
            )
        unreferenced = {b.block_id for b in self.blocks if b.ref_count == 0}
        if set(self.free_blocks) != unreferenced:
            return f"the {what} free list has {len(self.free_blocks)} blocks but {len(unreferenced)} are unreferenced"
        if (
            len(self.host_free) + len(held_host) != self.num_host_blocks
            or len(set(held_host) | set(self.host_free)) != self.num_host_blocks
        ):
            return (
                f"the {what} host swap pool has {len(self.host_free)} free and {len(held_host)} held blocks, "
                f"not its {self.num_host_blocks}"
            )
        return None
