"""The block tables the workers hold, for both KV groups, sent as deltas.

The step plan's TableSender sends each scheduled sequence's table (the full layers') as the blocks
kept from the front and the new tail (serve/runner/step_plan.py). A model with KV groups
(serve/scheduling/window_blocks.py) has a second table per sequence, its sliding layers', over a
pool of their own; it changes at both ends: blocks are added at its end as the full table's are,
and entries at its front turn NULL_BLOCK as they leave the window. So it travels as (nulls, keep,
tail): the first `nulls` entries are NULL_BLOCK, those up to `keep` stay as the worker holds them,
then the tail. At decode that is two numbers and usually no block; a swap-in or a recompute sends
its new table whole. The delta is worked out against what was sent, not from any rule about how
tables change, so any change arrives exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from baton.serve.runner.step_plan import Chunk, StepPlan, TableReceiver, TableSender, WireStep
from baton.serve.scheduling.window_blocks import NULL_BLOCK


@dataclass
class GroupWireStep(WireStep):
    """A WireStep whose chunks' window_table holds only the new tail (KV groups)."""

    window: list[tuple[int, int] | None] = field(default_factory=list)  # per chunk: (nulls, keep); None: one group


def _leading_nulls(table: list[int], start: int) -> int:
    """The number of NULL_BLOCK entries `table` starts with, the first `start` known to be."""
    i = start
    while i < len(table) and table[i] == NULL_BLOCK:
        i += 1
    return i


class GroupTableSender(TableSender):
    """The driver's copy of both groups' tables its workers hold."""

    def __init__(self) -> None:
        super().__init__()
        self.sent_window: dict[int, tuple[list[int], int]] = {}  # seq id -> (the table, its leading NULLs)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.sent_window.pop(seq_id, None)

    def _window_delta(self, seq_id: int, new: list[int]) -> tuple[int, int]:
        old, old_nulls = self.sent_window.get(seq_id, ([], 0))
        if new[: len(old)] == old:  # unchanged or grown at the end: the usual step, compared at C speed
            nulls, keep = old_nulls, len(old)
        else:  # entries left the window, or the table was replaced: look past the NULLs known so far
            known = old_nulls if new[:old_nulls] == old[:old_nulls] else 0
            nulls = keep = _leading_nulls(new, known)
            while keep < min(len(old), len(new)) and old[keep] == new[keep]:
                keep += 1
        self.sent_window[seq_id] = (list(new), nulls)
        return nulls, keep

    def encode(
        self, chunks: list[Chunk], positions_in_cache: bool, window_in_cache: bool, return_hidden: bool
    ) -> GroupWireStep:
        wire = super().encode(chunks, positions_in_cache, window_in_cache, return_hidden)
        deltas: list[tuple[int, int] | None] = []
        for i, c in enumerate(chunks):
            if c.window_table is None:
                deltas.append(None)
                continue
            nulls, keep = self._window_delta(c.seq_id, c.window_table)
            deltas.append((nulls, keep))
            wire.chunks[i] = dataclasses.replace(wire.chunks[i], window_table=c.window_table[keep:])
        return GroupWireStep(**vars(wire), window=deltas)


class GroupTableReceiver(TableReceiver):
    """A worker's tables of both groups, kept in step with the driver's GroupTableSender."""

    def __init__(self) -> None:
        super().__init__()
        self.window_tables: dict[int, list[int]] = {}

    def decode(self, step: GroupWireStep, block_size: int) -> StepPlan:
        for seq_id in step.released:
            self.window_tables.pop(seq_id, None)
        chunks = []
        for c, delta in zip(step.chunks, step.window):
            if delta is not None:
                nulls, keep = delta
                table = [NULL_BLOCK] * nulls + self.window_tables.get(c.seq_id, [])[nulls:keep] + c.window_table
                self.window_tables[c.seq_id] = table
                c = dataclasses.replace(c, window_table=table)
            chunks.append(c)
        return super().decode(dataclasses.replace(step, chunks=chunks), block_size)
