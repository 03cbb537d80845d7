"""InputBatch: the model runner's step tensors, with the block tables kept between steps.

StepPlan (serve/runner/step_plan.py) describes a step as plain lists; StepPlan.tensors turns them into
tensors from scratch. Most of that cost at a large decode batch is the block tables: a nested
list of every scheduled sequence's whole table, padded and converted, every step, although a
decoding sequence's table changes only when it takes a new block (one step in block_size).
Here every sequence keeps a row of a host table [rows, width] between steps (vLLM V1's
persistent InputBatch does the same); a step writes only the rows whose table differs from the
copy written last time, and takes the step's tables as one slice (rows in step order, the steady
state) or one gather of those rows. The comparison against the written copy is what keeps it
exact: whatever changed a table (a new block, copy-on-write, preemption, swap-in, eviction from
the front) shows as a difference, so no rule about who changes tables is relied on.

The one-dimensional inputs (ids, positions, slots, lengths) change every step anyway: they go
through numpy, a few times cheaper than torch.tensor on a list. Every tensor returned is new (a
copy, never a view of the kept table), so a step's metadata stays valid after later steps.

With KV groups (the plan has a WindowPlan) the sliding-window layers' tables keep rows of their own,
in a second InputBatch (`window`), made at the first such step.
"""

from __future__ import annotations

import numpy as np
import torch
from baton.serve.runner.attention import AttentionMetadata
from baton.serve.runner.step_plan import StepPlan

__all__ = ["InputBatch"]


class InputBatch:
    """Block-table rows by sequence id, for one model runner (or one worker's)."""

    def __init__(self, device: torch.device, rows: int = 64, width: int = 16):
        self.device = device
        self.table = np.zeros((rows, width), dtype=np.int32)  # row tails past a table's end are 0
        self.written: list[list[int] | None] = [None] * rows  # per row: the table last written there
        self.row_of: dict[int, int] = {}
        self.free = list(range(rows - 1, -1, -1))  # pop() takes the lowest row first
        self.num_row_writes = 0  # rows (re)written, in all steps so far
        self.window: InputBatch | None = None  # KV groups: the sliding-window layers' table rows

    def release(self, seq_id: int) -> None:
        """A sequence left: its row is zeroed and free for the next one."""
        r = self.row_of.pop(seq_id, None)
        if r is not None:
            self.table[r, : len(self.written[r])] = 0
            self.written[r] = None
            self.free.append(r)
        if self.window is not None:
            self.window.release(seq_id)

    def tensors(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [1, T], positions [1, T], attention metadata) on the device: equal to
        plan.tensors(device), the from-scratch build."""
        cu = plan.cu
        md = AttentionMetadata(
            slot_mapping=self._vec(plan.slots, np.int64),
            num_decodes=len(plan.dec_lens),
            decode_block_tables=self._tables(plan.dec_seqs, plan.dec_tables),
            decode_context_lens=self._vec(plan.dec_lens, np.int32),
            prefill_cu_seqlens=self._vec(cu, np.int32),
            prefill_block_tables=self._tables(plan.pre_seqs, plan.pre_tables),
            prefill_prefix_lens=self._vec(plan.pre_prefix, np.int32),
            max_prefill_len=max((b - a for a, b in zip(cu, cu[1:])), default=0),
            window_in_cache=plan.window_in_cache,
            trees=plan.tree_groups(),
        )
        if plan.window is not None:
            w, rows = plan.window, self.window or InputBatch(self.device)
            self.window = rows
            dec, pre = rows._tables(plan.dec_seqs, w.dec_tables), rows._tables(plan.pre_seqs, w.pre_tables)
            md.window = w.metadata(md, self._vec(w.slots, np.int64), dec, pre)
            rows._prune(plan.dec_seqs + plan.pre_seqs)
        self._prune(plan.dec_seqs + plan.pre_seqs)
        return self._vec(plan.ids, np.int64).view(1, -1), self._vec(plan.positions, np.int64).view(1, -1), md

    def _vec(self, values: list[int], dtype) -> torch.Tensor:
        t = torch.from_numpy(np.array(values, dtype=dtype))
        return t if self.device.type == "cpu" else t.to(self.device)

    def _tables(self, seq_ids: list[int], tables: list[list[int]]) -> torch.Tensor:
        """[len(tables), longest] int32, zero-padded: row i is tables[i], sequence seq_ids[i]'s."""
        if not tables:
            return torch.zeros(0, 0, dtype=torch.int32, device=self.device)
        width = max(map(len, tables))
        if width > self.table.shape[1]:
            self._grow(self.table.shape[0], max(width, 2 * self.table.shape[1]))
        rows, written, row_of = [], self.written, self.row_of
        for sid, t in zip(seq_ids, tables):
            r = row_of.get(sid)
            if r is None:
                r = self._new_row(sid)
            if written[r] != t:
                self._write(r, t)
            rows.append(r)
        n = len(rows)
        if rows[0] == 0 and rows[-1] == n - 1 and rows == list(range(n)):
            out = self.table[:n, :width].copy()  # the steady state: rows in step order
        else:
            out = self.table[:, :width][rows]  # a gather: a new array
        t = torch.from_numpy(out)
        return t if self.device.type == "cpu" else t.to(self.device)

    def _write(self, r: int, table: list[int]) -> None:
        old = self.written[r]
        self.table[r, : len(table)] = table
        if old is not None and len(old) > len(table):
            self.table[r, len(table) : len(old)] = 0
        self.written[r] = list(table)
        self.num_row_writes += 1

    def _new_row(self, seq_id: int) -> int:
        if not self.free:
            self._grow(2 * self.table.shape[0], self.table.shape[1])
        r = self.free.pop()
        self.row_of[seq_id] = r
        return r

    def _grow(self, rows: int, width: int) -> None:
        old = self.table
        self.table = np.zeros((rows, width), dtype=np.int32)
        self.table[: old.shape[0], : old.shape[1]] = old
        self.free = list(range(rows - 1, old.shape[0] - 1, -1)) + self.free
        self.written += [None] * (rows - old.shape[0])

    def _prune(self, step_ids: list[int]) -> None:
        """A runner that is never told who left (a worker: its driver's TableSender is) drops the
        rows of sequences outside this step once they far outnumber the step's."""
        if len(self.row_of) > 4 * len(step_ids) + 256:
            keep = set(step_ids)
            for sid in [s for s in self.row_of if s not in keep]:
                self.release(sid)
