"""State slots for hybrid (Mamba2 + attention) serving: the mixers' recurrent state beside the paged KV pool.

A hybrid's attention layers keep paged K/V blocks like any model; its Mamba2 mixers keep one
fixed-size state per sequence instead (the conv window and the SSM state, common/ssm.py's
MambaState), whatever the context length: a decode step reads and rewrites it in place.

  * StateSlots - bookkeeping, held by the BlockManager next to its blocks (the scheduler never
                 sees it): one device slot per running sequence, host slots for swap preemption,
                 prefix snapshots (the state where a cached prefix ends, found by the hash of that
                 prefix's last block, LRU-bounded, evicted with the block) and an ordered list of
                 slot copies for the runner to apply before the next forward.
  * StatePool  - the tensors: per mixer layer conv [slots, conv_dim, d_conv - 1] in the model
                 dtype and ssm [slots, heads, head_dim, d_state] in float32; device slots are the
                 running slots followed by the snapshot slots, one index space, so a restore or a
                 fork is one copy.
  * PagedHybridAttention - the runner's backend: paged attention for the attention layers, and
                 `mix` for the mixers, which runs each scheduled chunk from its slot's state (all
                 single-token decodes batched in one call) and writes the new state back. A chunk
                 that crosses a planned snapshot position is split there and the state at the
                 boundary copied to the snapshot slot. A speculative chunk runs token by token,
                 keeping every position's state, and leaves the slot alone: after verification
                 keep_state() writes the state at the last accepted token (rollback for free).

Budget (engine): the state slots are counted first against the KV byte budget - one per
schedulable sequence (max_num_seqs: a sequence cannot run without one), plus up to max_num_seqs
prefix snapshots with prefix caching on (at most a quarter of the budget) - and the rest becomes
KV blocks for the attention layers. Swap space is split the same way (at most half for states).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from baton.common.config import ConfigError, ModelConfig
from baton.common.ssm import Mamba2Mixer, MambaState
from baton.serve.attention import PagedAttention
from baton.serve.sequence import Sequence

if TYPE_CHECKING:
    from baton.serve.engine import EngineConfig

log = logging.getLogger(__name__)


@dataclass
class StateOp:
    kind: str  # "copy" (device slot -> device slot), "out" (device -> host), "in" (host -> device)
    src: int
    dst: int


def state_slot_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one sequence's recurrent state over all mixer layers."""
    inner = cfg.mamba_expand * cfg.hidden_size
    conv_dim = inner + 2 * cfg.mamba_n_groups * cfg.mamba_d_state
    elem = torch.tensor([], dtype=dtype).element_size()
    per_layer = conv_dim * (cfg.mamba_d_conv - 1) * elem + cfg.mamba_n_heads * cfg.mamba_d_head * cfg.mamba_d_state * 4
    mixers = sum(not cfg.is_attention_layer(i) for i in range(cfg.num_hidden_layers))
    return mixers * per_layer


@dataclass
class StateBudget:
    num_blocks: int
    num_slots: int
    num_snapshots: int
    slot_bytes: int

    @classmethod
    def split(
        cls, budget: int, block_bytes: int, slot_bytes: int, max_num_seqs: int, prefix_caching: bool
    ) -> "StateBudget":
        """State slots first (one per schedulable sequence, then snapshots), the rest as KV blocks."""
        running = max_num_seqs * slot_bytes
        if budget < running + block_bytes:
            raise ConfigError(
                f"the KV cache budget of {budget} bytes cannot hold {max_num_seqs} recurrent-state slots "
                f"({slot_bytes} bytes each, one per max_num_seqs) plus one {block_bytes}-byte KV block: "
                "raise the budget or lower max_num_seqs"
            )
        snaps = min(max_num_seqs, (budget // 4) // slot_bytes) if prefix_caching else 0
        blocks = (budget - (max_num_seqs + snaps) * slot_bytes) // block_bytes
        if blocks < 1:  # the snapshots give way to the blocks
            snaps = 0
            blocks = (budget - running) // block_bytes
        return cls(int(blocks), max_num_seqs, int(snaps), slot_bytes)


def check_hybrid(config: EngineConfig, mcfg: ModelConfig) -> None:
    """What the state slots cannot do yet fails here, before any work, with the reason."""
    c, spec = config, config.speculative
    why = None
    if c.parallel.world_size > 1:
        why = (
            "tensor/pipeline parallel serving is not supported for it: the sharded workers hold KV pools only, "
            "no recurrent-state slots, and the mixer's in_proj packs z, x, B, C and dt, so one rank's columns "
            "are five ranges the shard loader's one-range slices cannot express (serve it with tp = pp = 1)"
        )
    elif c.early_exit_threshold is not None:
        why = "CALM early exit skips layers for a token, and a skipped mixer's state would miss that token"
    elif c.streaming:
        why = "StreamingLLM evicts attention blocks, but the mixers' state keeps the whole past: it does not apply"
    elif spec is not None and (
        spec.method == "lookahead" or spec.tree_width > 1 or spec.tree_nodes or spec.tree_choices
    ):
        why = (
            f"speculative {spec.describe()} needs state per tree node or Jacobi window row; the state pool "
            "checkpoints a chain only (use a chain: ngram, draft or medusa without a tree)"
        )
    if why is not None:
        raise ConfigError(f"model_type {mcfg.model_type!r} (Mamba2 + attention hybrid): {why}")


def plan_states(
    config: EngineConfig, mcfg: ModelConfig, block_bytes: int, dtype: torch.dtype, budget_bytes: Callable[[], int]
) -> tuple[int, int, StateSlots]:
    """(KV blocks, host KV blocks, the slots) for a hybrid: the budget split as the module
    docstring says; with num_kv_blocks given the slots come on top of the blocks."""
    seqs, prefix, slot = config.scheduler.max_num_seqs, config.enable_prefix_caching, state_slot_bytes(mcfg, dtype)
    if config.num_kv_blocks is not None:
        split = StateBudget(config.num_kv_blocks, seqs, min(seqs, config.num_kv_blocks) if prefix else 0, slot)
    else:
        split = StateBudget.split(budget_bytes(), block_bytes, slot, seqs, prefix)
    host_slots = num_host = 0
    if config.scheduler.preemption_mode == "swap":
        host_slots = min(seqs, config.swap_space_bytes // 2 // slot)
        num_host = (config.swap_space_bytes - host_slots * slot) // block_bytes
    log.info(
        "hybrid: %d recurrent-state slots + %d prefix snapshots of %d bytes, %d KV blocks of %d bytes",
        split.num_slots, split.num_snapshots, slot, split.num_blocks, block_bytes,
    )  # fmt: skip
    return split.num_blocks, num_host, StateSlots(split.num_slots, split.num_snapshots, host_slots)


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


class StatePool:
    """The recurrent-state tensors of this runner's mixer layers (device slots, and host slots for swap)."""

    def __init__(self, mixers: dict[int, Mamba2Mixer], num_device: int, num_host: int, device, dtype, pin: bool):
        def alloc(n: int, dev, pin_memory: bool = False) -> dict[int, MambaState]:
            return {
                i: MambaState(
                    torch.zeros(
                        n, m.conv_dim, m.conv1d.kernel_size[0] - 1, dtype=dtype, device=dev, pin_memory=pin_memory
                    ),
                    torch.zeros(
                        n, m.num_heads, m.head_dim, m.d_state, dtype=torch.float32, device=dev, pin_memory=pin_memory
                    ),
                )
                for i, m in mixers.items()
            }

        self.device = device
        self.slots = alloc(num_device, device)
        self.host = alloc(num_host, "cpu", pin) if num_host else {}

    def apply(self, ops: list[StateOp]) -> None:
        """In the order they were issued (a slot freed and taken again sees them in sequence)."""
        for op in ops:
            src, dst = {
                "copy": (self.slots, self.slots),
                "out": (self.slots, self.host),
                "in": (self.host, self.slots),
            }[op.kind]
            for i, s in src.items():
                for a, b in ((s.conv, dst[i].conv), (s.ssm, dst[i].ssm)):
                    b[op.dst].copy_(a[op.src], non_blocking=True)

    def zero(self, slots: list[int]) -> None:
        if slots:
            idx = torch.tensor(slots, device=self.device)
            for s in self.slots.values():
                s.conv.index_fill_(0, idx, 0)
                s.ssm.index_fill_(0, idx, 0)

    def read(self, layer: int, idx: torch.Tensor) -> MambaState:
        s = self.slots[layer]
        return MambaState(s.conv[idx], s.ssm[idx])

    def write(self, layer: int, idx: torch.Tensor, state: MambaState) -> None:
        s = self.slots[layer]
        s.conv.index_copy_(0, idx, state.conv.to(s.conv.dtype))
        s.ssm.index_copy_(0, idx, state.ssm)


@dataclass
class Segment:
    """One scheduled chunk's rows in the packed step, as the mixers see it."""

    seq_id: int
    row: int
    length: int
    slot: int
    spec: bool  # a speculative chain: keep every position's state for keep_state()
    snapshots: list[tuple[int, int]]  # [(rows into the chunk, snapshot slot)]: the state there is kept


class PagedHybridAttention(PagedAttention):
    """Paged attention for the attention layers; `mix` runs the mixers over their state slots."""

    def __init__(self, kv_caches, kv_cache_dtype: str, pool: StatePool):
        super().__init__(kv_caches, kv_cache_dtype)
        self.pool = pool
        self.segments: list[Segment] = []
        self.spec_states: dict[int, tuple[int, dict[int, MambaState]]] = {}  # seq_id -> (slot, per layer [n, ...])

    def begin(self, segments: list[Segment]) -> None:
        """The step's chunks; index tensors are built here once, not once per mixer layer."""
        dev = self.pool.device
        decodes = [s for s in segments if s.length == 1 and not s.spec and not s.snapshots]
        self.segments = [s for s in segments if not (s.length == 1 and not s.spec and not s.snapshots)]
        self.spec_states = {s.seq_id: (s.slot, {}) for s in segments if s.spec}
        rows = [s.row for s in decodes]
        # The packing puts decode rows first: usually rows 0..n-1, a slice rather than a gather.
        self.decode_rows = slice(0, len(rows)) if rows == list(range(len(rows))) else torch.tensor(rows, device=dev)
        self.decode_slots = torch.tensor([s.slot for s in decodes], device=dev) if decodes else None
        self.slot_index = {s.slot: torch.tensor([s.slot], device=dev) for s in self.segments}

    def mix(self, mixer: Mamba2Mixer, x: torch.Tensor) -> torch.Tensor:
        """x [1, T, hidden] of the packed step -> the mixer's output, states read from and written to the slots."""
        layer, dev = mixer.layer_idx, x.device
        out = torch.empty_like(x)
        if self.decode_slots is not None:  # every single-token decode in one call, its state updated in place
            rows, idx = self.decode_rows, self.decode_slots
            y, state = mixer.mix(x[0, rows][:, None], self.pool.read(layer, idx))
            out[0, rows] = y[:, 0]
            self.pool.write(layer, idx, state)
        for s in self.segments:
            idx = self.slot_index[s.slot]
            state, xs = self.pool.read(layer, idx), x[:, s.row : s.row + s.length]
            if s.spec:
                ys, states = [], []
                for i in range(s.length):
                    y, state = mixer.mix(xs[:, i : i + 1], state)
                    ys.append(y)
                    states.append(state)
                out[:, s.row : s.row + s.length] = torch.cat(ys, dim=1)
                self.spec_states[s.seq_id][1][layer] = MambaState(
                    torch.cat([t.conv for t in states]), torch.cat([t.ssm for t in states])
                )
                continue
            ys, done = [], 0
            for cut, snap in s.snapshots:  # the chunk in pieces ending at the snapshot positions
                y, state = mixer.mix(xs[:, done:cut], state)
                ys.append(y)
                self.pool.write(layer, torch.tensor([snap], device=dev), state)
                done = cut
            if done < s.length:
                y, state = mixer.mix(xs[:, done:], state)
                ys.append(y)
            out[:, s.row : s.row + s.length] = torch.cat(ys, dim=1)
            self.pool.write(layer, idx, state)
        return out

    def keep_state(self, seq_id: int, num_accepted: int) -> None:
        """After verification: the slot takes the state after the chunk's num_accepted-th row."""
        slot, layers = self.spec_states.pop(seq_id, (None, {}))
        for layer, st in layers.items():
            i = num_accepted - 1
            self.pool.write(
                layer, torch.tensor([slot], device=st.ssm.device), MambaState(st.conv[i : i + 1], st.ssm[i : i + 1])
            )
