"""LayerSkip's late entry: rows whose layer-E input is already known enter the step at layer E.

LayerSkip's self-speculative draft (serve/speculative/layerskip.py) is the model's own first E
layers, run on the engine's runner: each draft depth writes the K/V of layers < E into the paged
cache at the rows' real slots and yields the rows' layer-E inputs. Installed on that ModelRunner
from outside (install_late_entry, as the fused passes are), a LateEntries keeps those inputs and
runs the next step's layers its own way (the runner's step pass): the kept rows enter at E, the
other rows of the step (the last proposal, which the draft never fed, and every other sequence's
prefill or decode) run layers < E as a sub-batch of their own, then every row runs layers >= E in
one pass, the last of them for the sampled rows alone as in a plain step. Nothing below E is
computed twice, and each row's numbers are the ones a plain step computes.

An entry serves only the step right after its draft (the step pass takes them all), and only for
the same tokens at the same slots from the chunk's first token (`_fits`): a preempted, truncated,
swapped or re-slotted sequence runs from the embedding instead.

A tensor-parallel engine (T x 1, serve/parallel/driver.py) installs one on every rank's runner:
each draft depth is one command every rank runs through its own LateEntries, each keeps the rows'
layer-E inputs (replicated: every layer ends in an all-reduce), and every rank decides alike since
it sees the same commands - no hidden state crosses a process. Pipeline stages cannot (layers < E
and the LM head are on different stages): the proposer keeps its mirror draft there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from baton.serve.runner.model_runner import ModelRunner
from baton.serve.runner.step_plan import DECODE_ROWS, Chunk, StepPlan

__all__ = ["Drafter", "LateEntries", "LateEntry", "LateEntryRanks", "install_late_entry"]


@dataclass
class LateEntry:
    """Rows of one sequence that enter the next step at layer E: their K/V below it are in the
    cache already, written by the draft at these very slots."""

    start: int  # token index of the first row
    tokens: list[int]
    hidden: torch.Tensor  # [len(tokens), hidden]: the input of layer E
    slots: list[int]  # the cache slots the rows' K/V were written to


class Drafter(Protocol):
    """What LayerSkip's KV-reusing proposer drafts through: LateEntries in this process, or a
    sharded model's driver running one on every rank (LateEntryRanks)."""

    num_late_rows: int  # rows that entered at E, in all steps so far

    def draft(self, chunks: list[Chunk], fresh: bool) -> torch.Tensor:
        """One draft depth over one-token chunks: their logits [rows, vocab]; their layer-E inputs
        are kept for the next step (`fresh`: a proposal's first depth, replacing what was kept)."""
        ...


@runtime_checkable
class LateEntryRanks(Protocol):
    """A runner over worker processes that installs late entry on each rank's own ModelRunner."""

    def install_late_entry(self, exit_layer: int) -> Drafter | None:
        """Late entry at `exit_layer` on every rank; None where this runner cannot (pipeline stages)."""
        ...


class LateEntries:
    """Late entry at layer `exit_layer` on one ModelRunner: the kept rows, the draft that keeps them
    and the step pass that lets them in (module docstring). A Drafter."""

    def __init__(self, runner: ModelRunner, exit_layer: int):
        n = runner.model.config.num_hidden_layers
        if runner.layer_ids != range(n):  # a pipeline stage: the step pass runs layers >= E up to the last
            raise ValueError(f"late entry needs every layer on one runner: this one holds {runner.layer_ids} of {n}")
        self.runner, self.exit_layer = runner, exit_layer
        self.entries: dict[int, LateEntry] = {}  # by sequence: the rows the next step may let in at E
        self.num_late_rows = 0

    @torch.inference_mode()
    def draft(self, chunks: list[Chunk], fresh: bool) -> torch.Tensor:
        """Layers < E over one-token chunks (one row each, in order), writing their K/V into the
        cache; each row's layer-E input extends its sequence's entry (a new one where `fresh` or
        where it does not follow on). Returns the rows' logits through the runner's final norm and
        LM head (a tensor rank's vocab-parallel head gathers the full rows)."""
        r = self.runner
        plan = StepPlan.from_chunks(chunks, r.block_size)
        x = r.forward(plan, layers=range(self.exit_layer))
        for i, c in enumerate(chunks):
            row = x[0, i : i + 1]
            e = None if fresh else self.entries.get(c.seq_id)
            if e is None or e.start + len(e.tokens) != c.start:
                self.entries[c.seq_id] = LateEntry(c.start, list(c.tokens), row, [plan.slots[i]])
            else:
                e.tokens += c.tokens
                e.hidden = torch.cat([e.hidden, row])
                e.slots.append(plan.slots[i])
        logits, _ = r.head(plan, x)
        return logits

    @torch.inference_mode()
    def __call__(self, plan: StepPlan, positions_in_cache: bool) -> torch.Tensor:
        """The runner's step pass: every layer over the plan's rows, the kept rows entering at E
        (module docstring). Returns what ModelRunner.forward would: [1, T, hidden], or the sampled
        rows' alone where the runner answers those only."""
        r, E = self.runner, self.exit_layer
        entries, self.entries = self.entries, {}  # for this step only
        low, late_rows, late_hidden, row = [], [], [], 0
        for c in plan.chunks:  # in packing order
            e, m = entries.get(c.seq_id), 0
            if e is not None and self._fits(e, c):
                while m < len(c.tokens) and m < len(e.tokens) and e.tokens[m] == c.tokens[m]:
                    m += 1
                late_rows += range(row, row + m)
                late_hidden.append(e.hidden[:m])
            if m < len(c.tokens):
                low.append((dataclasses.replace(c, start=c.start + m, tokens=c.tokens[m:]), row + m))
            row += len(c.tokens)
        trim = r.answer_sampled_rows  # the last layer for the sampled rows only, as in a plain step
        if not late_rows:
            return r.forward(plan, sampled_only=trim)
        low.sort(key=lambda x: (x[0].spec_parents is not None, len(x[0].tokens) > DECODE_ROWS))  # packing order
        cfg = r.model.config
        x = torch.empty(1, plan.num_tokens, cfg.hidden_size, dtype=r.dtype, device=r.device)
        if low:
            sub = StepPlan.from_chunks([c for c, _ in low], r.block_size, positions_in_cache, plan.window_in_cache)
            rows = [at + i for c, at in low for i in range(len(c.tokens))]
            x[0, torch.tensor(rows, device=r.device)] = r.forward(sub, layers=range(E))[0]
        x[0, torch.tensor(late_rows, device=r.device)] = torch.cat(late_hidden).to(r.dtype)
        self.num_late_rows += len(late_rows)
        return r.forward(plan, x, layers=range(E, cfg.num_hidden_layers), sampled_only=trim)

    def _fits(self, e: LateEntry, c: Chunk) -> bool:
        """Written for this chunk: from its first token, at the slots its rows have now (not a tree)."""
        if c.start != e.start or c.spec_parents is not None:
            return False
        bs, first = self.runner.block_size, c.start - c.evicted
        n = min(len(c.tokens), len(e.tokens))
        return all(c.block_table[(first + i) // bs] * bs + (first + i) % bs == e.slots[i] for i in range(n))


def install_late_entry(runner: ModelRunner, exit_layer: int) -> LateEntries:
    """Late entry at `exit_layer` on `runner`, as its step pass: the rows a draft keeps enter its
    next step at that layer."""
    late = LateEntries(runner, exit_layer)
    runner.step_pass = late
    return late
