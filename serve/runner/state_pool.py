"""State pools for hybrid (Mamba2 + attention) serving: the mixers' recurrent state beside the paged KV pool.

A hybrid's attention layers keep paged K/V blocks like any model; its Mamba2 mixers keep one
fixed-size state per sequence instead (the conv window and the SSM state, common/ssm.py's
MambaState), whatever the context length: a decode step reads and rewrites it in place. Which
slot holds whose state is serve/scheduling/state_slots.py's (StateSlots, held by the BlockManager);
this file holds the tensors and the attention backend that runs the mixers:

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

How many slots there are is serve/engine/sizing.py's (counted first against the KV byte budget);
what hybrids cannot be combined with yet is serve/engine/rules.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from baton.common.ssm import Mamba2Mixer, MambaState
from baton.serve.runner.attention import PagedAttention
from baton.serve.scheduling.state_slots import StateOp

log = logging.getLogger(__name__)


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
