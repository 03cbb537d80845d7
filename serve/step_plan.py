"""StepPlan: everything one forward needs, as plain lists: the per-step control-plane message.

The model runner builds it from the scheduled sequences (which only the driver holds); with
tensor/pipeline parallelism the driver broadcasts it and every rank turns it into tensors on its
own device (serve/parallel/). It carries what changes per step - token ids, positions, slot
mapping, the block tables of the scheduled sequences, the rows to sample - never Sequence objects.

Packing: decode rows first (single new tokens, and every row of a chunk of at most DECODE_ROWS
tokens: speculative chains, prompt tails), then longer prefill chunks, then speculative trees. A
chunk's K/V are written to the cache before attention, so its row i is exactly a decode over the
cache up to itself (context prefix + i + 1): the decode kernel serves it without the prefill
path's per-sequence prefix gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.serve.attention import AttentionMetadata, TreeGroup
from baton.serve.sequence import Sequence
from baton.serve.speculative.tree import ancestor_mask, tree_depths

DECODE_ROWS = 8  # chunks up to this long run as decode rows (each re-reads the prefix: short only)


@dataclass
class TreeSpec:
    row: int
    size: int
    block_table: list[int]
    prefix_len: int
    depth: list[int]
    parents: list[int]


@dataclass
class StepPlan:
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    dec_tables: list[list[int]] = field(default_factory=list)
    dec_lens: list[int] = field(default_factory=list)
    pre_tables: list[list[int]] = field(default_factory=list)
    pre_prefix: list[int] = field(default_factory=list)
    cu: list[int] = field(default_factory=lambda: [0])
    trees: list[TreeSpec] = field(default_factory=list)
    window_in_cache: bool = True
    sample_rows: list[int] = field(default_factory=list)
    return_hidden: bool = False

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
    ) -> tuple["StepPlan", list[tuple[Sequence, int]]]:
        """The plan and [(sequence, rows it samples)] in sampled-row order."""
        bs = block_size
        trees = [x for x in scheduled if x[0].spec_parents is not None]
        chains = [x for x in scheduled if x[0].spec_parents is None]
        order = [x for x in chains if x[1] <= DECODE_ROWS] + [x for x in chains if x[1] > DECODE_ROWS] + trees
        plan = cls(window_in_cache=window_in_cache, return_hidden=return_hidden)
        groups: list[tuple[Sequence, int]] = []
        for seq, n in order:
            start = seq.num_computed_tokens
            first_cached = start - seq.num_evicted_tokens  # index of this chunk's first token in the cache
            row0 = len(plan.ids)
            plan.ids += (seq.token_ids + seq.spec_token_ids)[start : start + n]
            base = first_cached if positions_in_cache else start
            if seq.spec_parents is not None:
                depth = tree_depths(seq.spec_parents)
                plan.positions += [base] + [base + d for d in depth]
                plan.trees.append(
                    TreeSpec(row0, n, list(seq.block_table), first_cached, [0] + depth, list(seq.spec_parents))
                )
            else:
                plan.positions += range(base, base + n)
            table = seq.block_table
            plan.slots += [table[c // bs] * bs + c % bs for c in range(first_cached, first_cached + n)]
            if seq.spec_parents is None and n <= DECODE_ROWS:
                plan.dec_tables += [table] * n
                plan.dec_lens += range(first_cached + 1, first_cached + n + 1)
            elif seq.spec_parents is None:
                plan.pre_tables.append(table)
                plan.pre_prefix.append(first_cached)
                plan.cu.append(plan.cu[-1] + n)
            if seq.spec_token_ids:
                rows = list(range(row0, row0 + n))  # every proposal is checked
            elif start + n == seq.num_tokens:
                rows = [len(plan.ids) - 1]
            else:
                continue
            plan.sample_rows += rows
            groups.append((seq, len(rows)))
        return plan, groups

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [1, T], positions [1, T], attention metadata) on `device`."""
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
            trees=[
                TreeGroup(t.row, t.size, t.block_table, t.prefix_len, t.depth, ancestor_mask(t.parents))
                for t in self.trees
            ],
        )
        input_ids = torch.tensor([self.ids], dtype=torch.long, device=dev)
        pos = torch.tensor([self.positions], dtype=torch.long, device=dev)
        return input_ids, pos, md


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
