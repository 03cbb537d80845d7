"""StepPlan: everything one forward needs, as plain lists: the per-step control-plane message.

The model runner builds it from the scheduled sequences (which only the driver holds); with
tensor/pipeline parallelism the driver broadcasts it and every rank turns it into tensors on its
own device (serve/parallel/; the runner's InputBatch does it, keeping block-table rows between
steps). It carries what changes per step - token ids, positions, slot mapping, the block tables
of the scheduled sequences, the rows to sample - never Sequence objects.

Packing: decode rows first (single new tokens, and every row of a chunk of at most DECODE_ROWS
tokens: speculative chains, prompt tails), then longer prefill chunks, then speculative trees. A
chunk's K/V are written to the cache before attention, so its row i is exactly a decode over the
cache up to itself (context prefix + i + 1): the decode kernel serves it without the prefill
path's per-sequence prefix gather.

KV groups (a model mixing sliding-window and full layers: serve/scheduling/window_blocks.py): the
sliding layers keep blocks of their own, so a chunk carries their table too (`window_table`), and
the plan their slot mapping and block tables row for row with the full layers' (`window`, a
WindowPlan); the attention backend reads them for the layers with a window.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from baton.serve.core.sequence import Sequence
from baton.serve.core.token_tree import ancestor_mask, tree_depths
from baton.serve.runner.attention import AttentionMetadata, TreeGroup

DECODE_ROWS = 8  # chunks up to this long run as decode rows (each re-reads the prefix: short only)


@dataclass
class TreeSpec:
    row: int
    size: int
    block_table: list[int]
    prefix_len: int
    depth: list[int]
    parents: list[int]


@dataclass(slots=True)
class Chunk:
    """One scheduled sequence's part of a step, without the Sequence: what a worker needs."""

    seq_id: int
    start: int  # tokens already computed
    evicted: int  # tokens dropped from the front of its cache (StreamingLLM / sliding window)
    tokens: list[int]  # the chunk's token ids
    block_table: list[int]
    spec_parents: list[int] | None  # a speculative tree
    sample: str  # "all" rows (speculative proposals are checked), "last", or "none" (a prompt chunk)
    window_table: list[int] | None = None  # KV groups: the sliding-window layers' block table

    @classmethod
    def of(cls, seq: Sequence, n: int) -> "Chunk":
        start, ids, spec = seq.num_computed_tokens, seq.token_ids, seq.spec_token_ids
        if spec:
            tokens, sample = (ids + spec)[start : start + n], "all"
        else:
            tokens, sample = ids[start : start + n], "last" if start + n == len(ids) else "none"
        parents = None if seq.spec_parents is None else list(seq.spec_parents)
        return cls(
            seq.seq_id, start, seq.num_evicted_tokens, tokens, seq.block_table, parents, sample, seq.window_block_table
        )


@dataclass
class WindowPlan:
    """The sliding-window layers' own slot mapping and block tables (KV groups), row for row as
    the plan's: per token, per decode row, per prefill chunk, per tree."""

    slots: list[int] = field(default_factory=list)
    dec_tables: list[list[int]] = field(default_factory=list)
    pre_tables: list[list[int]] = field(default_factory=list)
    tree_tables: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, chunks: list[Chunk], block_size: int) -> WindowPlan:
        bs, w = block_size, cls()
        for c in chunks:
            n, first, table = len(c.tokens), c.start - c.evicted, c.window_table
            w.slots += [table[i // bs] * bs + i % bs for i in range(first, first + n)]
            if c.spec_parents is not None:
                w.tree_tables.append(table)
            elif n <= DECODE_ROWS:
                w.dec_tables += [table] * n
            else:
                w.pre_tables.append(table)
        return w

    def metadata(self, md: AttentionMetadata, slots, dec_tables, pre_tables) -> AttentionMetadata:
        """md (the full layers') with this group's slots and tables (tensors, built by the caller)."""
        trees = [dataclasses.replace(t, block_table=wt) for t, wt in zip(md.trees, self.tree_tables)]
        return dataclasses.replace(
            md, slot_mapping=slots, decode_block_tables=dec_tables, prefill_block_tables=pre_tables, trees=trees
        )


@dataclass
class StepPlan:
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    dec_tables: list[list[int]] = field(default_factory=list)
    dec_seqs: list[int] = field(default_factory=list)  # per decode row: its sequence (InputBatch's row key)
    dec_lens: list[int] = field(default_factory=list)
    pre_tables: list[list[int]] = field(default_factory=list)
    pre_seqs: list[int] = field(default_factory=list)
    pre_prefix: list[int] = field(default_factory=list)
    cu: list[int] = field(default_factory=lambda: [0])
    trees: list[TreeSpec] = field(default_factory=list)
    window_in_cache: bool = True
    sample_rows: list[int] = field(default_factory=list)
    return_hidden: bool = False
    chunks: list[Chunk] = field(default_factory=list)  # what the plan was built from, in packing order
    window: WindowPlan | None = None  # KV groups: the sliding-window layers' slots and tables

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @classmethod
    def build(
        cls,
        scheduled: list[tuple[Sequence, int]],
        block_size: int,
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
    ) -> tuple[StepPlan, list[tuple[Sequence, int]]]:
        """The plan and [(sequence, rows it samples)] in sampled-row order."""
        chunks, groups = plan_chunks(scheduled)
        return cls.from_chunks(chunks, block_size, positions_in_cache, window_in_cache, return_hidden), groups

    @classmethod
    def from_chunks(
        cls,
        chunks: list[Chunk],
        block_size: int,
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
    ) -> StepPlan:
        """The plan of chunks already in packing order (what a worker rebuilds from the wire)."""
        bs = block_size
        plan = cls(window_in_cache=window_in_cache, return_hidden=return_hidden, chunks=chunks)
        for c in chunks:
            n = len(c.tokens)
            first_cached = c.start - c.evicted  # index of this chunk's first token in the cache
            row0 = len(plan.ids)
            if n == 1 and c.spec_parents is None:  # a decoding sequence, most rows at decode: the loop's short way
                table = c.block_table
                plan.ids.append(c.tokens[0])
                plan.positions.append(first_cached if positions_in_cache else c.start)
                plan.slots.append(table[first_cached // bs] * bs + first_cached % bs)
                plan.dec_tables.append(table)
                plan.dec_seqs.append(c.seq_id)
                plan.dec_lens.append(first_cached + 1)
                if c.sample != "none":  # one row: "all" and "last" sample it alike
                    plan.sample_rows.append(row0)
                continue
            plan.ids += c.tokens
            base = first_cached if positions_in_cache else c.start
            table = c.block_table
            if c.spec_parents is not None:
                depth = tree_depths(c.spec_parents)
                plan.positions += [base] + [base + d for d in depth]
                plan.trees.append(TreeSpec(row0, n, table, first_cached, [0] + depth, c.spec_parents))
            else:
                plan.positions += range(base, base + n)
            plan.slots += [table[i // bs] * bs + i % bs for i in range(first_cached, first_cached + n)]
            if c.spec_parents is None and n <= DECODE_ROWS:
                plan.dec_tables += [table] * n
                plan.dec_seqs += [c.seq_id] * n
                plan.dec_lens += range(first_cached + 1, first_cached + n + 1)
            elif c.spec_parents is None:
                plan.pre_tables.append(table)
                plan.pre_seqs.append(c.seq_id)
                plan.pre_prefix.append(first_cached)
                plan.cu.append(plan.cu[-1] + n)
            if c.sample == "all":
                plan.sample_rows += range(row0, row0 + n)
            elif c.sample == "last":
                plan.sample_rows.append(len(plan.ids) - 1)
        if chunks and chunks[0].window_table is not None:
            plan.window = WindowPlan.of(chunks, bs)
        return plan

    def tree_groups(self) -> list[TreeGroup]:
        """The speculative trees as attention takes them, each with its ancestor mask."""
        return [
            TreeGroup(t.row, t.size, t.block_table, t.prefix_len, t.depth, ancestor_mask(t.parents)) for t in self.trees
        ]

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [1, T], positions [1, T], attention metadata) on `device`, built from the
        lists alone: the reference the model runner's InputBatch (serve/runner/input_batch.py), which
        keeps block-table rows between steps, is tested against."""
        dev = device

        def table(rows: list[list[int]]) -> torch.Tensor:
            width = max((len(r) for r in rows), default=0)
            return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=dev).reshape(
                len(rows), width
            )

        cu = self.cu
        md = AttentionMetadata(
            slot_mapping=torch.tensor(self.slots, dtype=torch.int64, device=dev),
            num_decodes=len(self.dec_lens),
            decode_block_tables=table(self.dec_tables),
            decode_context_lens=torch.tensor(self.dec_lens, dtype=torch.int32, device=dev),
            prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_block_tables=table(self.pre_tables),
            prefill_prefix_lens=torch.tensor(self.pre_prefix, dtype=torch.int32, device=dev),
            max_prefill_len=max((b - a for a, b in zip(cu, cu[1:])), default=0),
            window_in_cache=self.window_in_cache,
            trees=self.tree_groups(),
        )
        if self.window is not None:
            w = self.window
            slots = torch.tensor(w.slots, dtype=torch.int64, device=dev)
            md.window = w.metadata(md, slots, table(w.dec_tables), table(w.pre_tables))
        input_ids = torch.tensor([self.ids], dtype=torch.long, device=dev)
        pos = torch.tensor([self.positions], dtype=torch.long, device=dev)
        return input_ids, pos, md


def plan_chunks(scheduled: list[tuple[Sequence, int]]) -> tuple[list[Chunk], list[tuple[Sequence, int]]]:
    """The step's chunks in packing order - decode rows, then prefill chunks, then speculative
    trees (see the module docstring) - and [(sequence, rows it samples)] in sampled-row order."""
    rows, chunked, trees = [], [], []
    for x in scheduled:
        (trees if x[0].spec_parents is not None else rows if x[1] <= DECODE_ROWS else chunked).append(x)
    order = rows + chunked + trees
    chunks = [Chunk.of(seq, n) for seq, n in order]
    groups = [(seq, n if c.sample == "all" else 1) for (seq, n), c in zip(order, chunks) if c.sample != "none"]
    return chunks, groups


@dataclass
class WireStep:
    """A step as it travels to the workers: the chunks with each block table sent as a delta
    against the table the workers already hold for that sequence (the blocks kept from the front,
    then the new tail: usually nothing or one new block), and the sequences to forget. (A chunk's
    window_table, KV groups, travels whole here; serve/parallel/tables.py sends it as a delta too.)"""

    chunks: list[Chunk]  # block_table holds only the new tail
    keep: list[int]  # per chunk: leading blocks of the previous table that stay
    released: list[int]
    positions_in_cache: bool
    window_in_cache: bool
    return_hidden: bool


class TableSender:
    """The driver's copy of the block tables its workers hold."""

    def __init__(self) -> None:
        self.sent: dict[int, list[int]] = {}
        self.released: list[int] = []

    def release(self, seq_id: int) -> None:
        if self.sent.pop(seq_id, None) is not None:
            self.released.append(seq_id)

    def encode(
        self, chunks: list[Chunk], positions_in_cache: bool, window_in_cache: bool, return_hidden: bool
    ) -> WireStep:
        wire, keep = [], []
        for c in chunks:
            old, new = self.sent.get(c.seq_id, []), c.block_table
            k = 0
            while k < len(old) and k < len(new) and old[k] == new[k]:
                k += 1
            self.sent[c.seq_id] = list(new)
            keep.append(k)
            wire.append(dataclasses.replace(c, block_table=new[k:]))
        released, self.released = self.released, []
        return WireStep(wire, keep, released, positions_in_cache, window_in_cache, return_hidden)


class TableReceiver:
    """A worker's block tables, kept in step with the driver's TableSender."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def decode(self, step: WireStep, block_size: int) -> StepPlan:
        for seq_id in step.released:
            self.tables.pop(seq_id, None)
        chunks = []
        for c, k in zip(step.chunks, step.keep):
            table = self.tables.get(c.seq_id, [])[:k] + c.block_table
            self.tables[c.seq_id] = table
            chunks.append(dataclasses.replace(c, block_table=table))
        return StepPlan.from_chunks(
            chunks, block_size, step.positions_in_cache, step.window_in_cache, step.return_hidden
        )


def split_for_pipeline(scheduled: list[tuple[Sequence, int]], parts: int) -> list[list[tuple[Sequence, int]]]:
    """Up to `parts` contiguous groups of about equal token counts: the micro-batches one step
    sends through the pipeline (stage s works on micro-batch m while stage s+1 works on m-1)."""
    total = sum(n for _, n in scheduled)
    groups: list[list[tuple[Sequence, int]]] = [[]]
    done = 0
    for item in scheduled:
        if groups[-1] and len(groups) < parts and done >= total * len(groups) / parts:
            groups.append([])
        groups[-1].append(item)
        done += item[1]
    return groups
