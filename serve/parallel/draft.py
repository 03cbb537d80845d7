"""LayerSkip's draft on a sharded model: every rank runs its shard of layers < E, keeping the hidden states.

One draft depth is one small command (a WireStep of one-token chunks: the token each sequence
feeds, its block-table delta). Every tensor rank writes the K/V of its heads for layers < E into
its own paged cache at the rows' real slots, runs the shared final norm and the vocab-parallel LM
head (an all-gather: the driver gets the full logits and draws the next token), and records each
row's layer-E input - replicated on every tensor rank, since each layer ends in an all-reduce - as
a LateEntry in its own runner. The next step then runs ModelRunner.forward_late on every rank
(worker.run_stage): the drafted rows enter at E from the states each rank kept, so no hidden state
crosses a process. Entries are only ever used by the next step, for the same tokens at the same
slots (ModelRunner._entry_fits), exactly as in a single process; every rank decides alike since
it sees the same commands.
"""

from __future__ import annotations

import torch
from baton.serve.runner.model_runner import LateEntry, ModelRunner
from baton.serve.runner.step_plan import Chunk, StepPlan


@torch.inference_mode()
def draft_pass(runner: ModelRunner, plan: StepPlan, chunks: list[Chunk], exit_layer: int, fresh: bool) -> torch.Tensor:
    """One draft depth on this rank's shard: one row per chunk, in the chunks' order. `fresh`:
    the first depth of a proposal, which replaces what the rank kept for these sequences.
    Returns the rows' logits [rows, vocab] (every tensor rank holds them after the all-gather)."""
    runner.entry_layer = exit_layer
    x = runner.forward(plan, layers=range(exit_layer))
    logits, _ = runner.head(plan, x)
    for i, c in enumerate(chunks):
        row = x[0, i : i + 1]
        e = None if fresh else runner.late_entries.get(c.seq_id)
        if e is None or e.start + len(e.tokens) != c.start:
            runner.late_entries[c.seq_id] = LateEntry(
                c.start, list(c.tokens), row, [plan.slots[i]], runner.num_executes
            )
        else:
            e.tokens += c.tokens
            e.hidden = torch.cat([e.hidden, row])
            e.slots.append(plan.slots[i])
    return logits
