"""Which recurrent-state slot holds whose state, for hybrid (Mamba2 + attention) models: the
bookkeeping the BlockManager keeps next to its blocks (the scheduler never sees it). One device slot
per running sequence, host slots for swap preemption, prefix snapshots (the state where a cached
prefix ends, found by the hash of that prefix's last block, LRU-bounded, evicted with the block),
and an ordered list of slot copies (StateOp) for the runner to apply before the next forward. The
tensors are serve/runner/state_pool.py's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from baton.serve.core.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class StateOp:
    kind: str  # "copy" (device slot -> device slot), "out" (device -> host), "in" (host -> device)
    src: int
    dst: int


class StateSlots:
    """Which slot holds whose state (no tensors; see the module docstring)."""

    def __init__(self, num_slots: int, num_snapshots: int = 0, num_host: int = 0):
        self.num_slots, self.num_snapshots, self.num_host = num_slots, num_snapshots, num_host
        self.free = list(range(num_slots))[::-1]
        self.snap_free = list(range(num_slots, num_slots + num_snapshots))[::-1]
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recent first
        self.host_free = list(range(num_host))[::-1]
        self.slot_of: dict[int, int] = {}
        self.host_of: dict[int, int] = {}
        self.restore: dict[int, int] = {}  # seq_id -> snapshot slot to copy in when it takes its slot
        self.pending: dict[int, list[tuple[int, int, bytes]]] = {}  # seq_id -> [(position, snapshot slot, hash)]
        self.diverged: dict[int, int] = {}  # seq_id -> where its KV prefix hit ended without a snapshot
        self.ops: list[StateOp] = []
        self.snapshot_hits = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def can_take(self, seq: Sequence) -> bool:
        return seq.seq_id in self.slot_of or bool(self.free)

    def take(self, seq: Sequence) -> None:
        """Give seq a slot if it has none (from the snapshot its prefix hit, if any)."""
        if seq.seq_id in self.slot_of:
            return
        slot = self.slot_of[seq.seq_id] = self.free.pop()
        src = self.restore.pop(seq.seq_id, None)
        if src is not None:
            self.ops.append(StateOp("copy", src, slot))

    def release(self, seq: Sequence) -> None:
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.free.append(slot)
        self.restore.pop(seq.seq_id, None)
        self.diverged.pop(seq.seq_id, None)
        self.snap_free += [slot for _, slot, _ in self.pending.pop(seq.seq_id, [])]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child starts from a copy of the parent's state (its slot was reserved at admission)."""
        slot = self.slot_of[child.seq_id] = self.free.pop()
        self.ops.append(StateOp("copy", self.slot_of[parent.seq_id], slot))

    # ------------------------------------------------------------------------ swapping
    def can_swap_out(self) -> bool:
        return bool(self.host_free)

    def swap_out(self, seq: Sequence) -> None:
        host = self.host_of[seq.seq_id] = self.host_free.pop()
        slot = self.slot_of.pop(seq.seq_id)
        self.ops.append(StateOp("out", slot, host))
        self.free.append(slot)

    def swap_in(self, seq: Sequence) -> None:
        host = self.host_of.pop(seq.seq_id)
        slot = self.slot_of[seq.seq_id] = self.free.pop()
        self.ops.append(StateOp("in", host, slot))
        self.host_free.append(host)

    def free_host(self, seq: Sequence) -> None:
        host = self.host_of.pop(seq.seq_id, None)
        if host is not None:
            self.host_free.append(host)

    # ------------------------------------------------------------------------ prefix snapshots
    def has_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self.snapshots

    def plan_restore(self, seq: Sequence, block_hash: bytes) -> None:
        self.snapshots.move_to_end(block_hash)
        self.restore[seq.seq_id] = self.snapshots[block_hash]
        self.snapshot_hits += 1

    def plan_snapshot(self, seq: Sequence, position: int, block_hash: bytes) -> None:
        """Keep seq's state after `position` tokens (a block boundary) in this step's forward."""
        mine = self.pending.setdefault(seq.seq_id, [])
        if not self.num_snapshots or block_hash in self.snapshots or any(p == position for p, _, _ in mine):
            return
        if self.snap_free:
            slot = self.snap_free.pop()
        elif self.snapshots:
            _, slot = self.snapshots.popitem(last=False)
        else:
            return
        mine.append((position, slot, block_hash))

    def snapshots_at(self, seq_id: int) -> list[tuple[int, int]]:
        """[(position, snapshot slot)] planned for this sequence's chunk now, in position order."""
        return sorted((p, slot) for p, slot, _ in self.pending.get(seq_id, []))

    def publish(self, seq: Sequence) -> None:
        """After the forward: the planned snapshots are written and findable."""
        for p, slot, h in self.pending.pop(seq.seq_id, []):
            if p > seq.num_computed_tokens or h in self.snapshots:  # (not computed: the step failed)
                self.snap_free.append(slot)
            else:
                self.snapshots[h] = slot

    def evict(self, block_hash: bytes) -> None:
        """The prefix's last block left the prefix cache: its snapshot goes with it."""
        slot = self.snapshots.pop(block_hash, None)
        if slot is not None:
            self.snap_free.append(slot)

    def take_ops(self) -> list[StateOp]:
        ops, self.ops = self.ops, []
        return ops

    def problem(self, live: Iterable[Sequence]) -> str | None:
        """None if every slot is either free or held by a live sequence (running, snapshot, host); else why not."""
        ids = {s.seq_id for s in live}
        held = list(self.slot_of.values())
        if set(self.slot_of) - ids or len(held) + len(self.free) != self.num_slots:
            return f"state slots: {len(held)} held and {len(self.free)} free, not the pool's {self.num_slots}"
        snaps = len(self.snapshots) + sum(map(len, self.pending.values())) + len(self.snap_free)
        if set(self.pending) - ids or snaps != self.num_snapshots:
            return f"state snapshots: {snaps} accounted for, not the pool's {self.num_snapshots}"
        if set(self.host_of) - ids or len(self.host_of) + len(self.host_free) != self.num_host:
            return f"host state slots: {len(self.host_of)} held and {len(self.host_free)} free, not {self.num_host}"
        return None
