"""SpeculativeDecoder: all the engine does for speculation, in two calls a step.

Before the schedule, propose() asks the proposer for the sequences about to decode (k per
sequence from adaptive k, within max_tokens and the context). The scheduler fits the proposals
into the step's token budget and the model runner packs them into the forward. After it,
verify() walks each sequence's chain/tree with `choose`, appends every token it keeps through the
engine's callback, compacts the accepted path's KV into a chain and frees the rejected slots.
"""

from __future__ import annotations

from typing import Callable

import torch
from baton.serve.core.faults import FaultInjector, SequenceFailure, per_sequence
from baton.serve.core.sequence import Sequence
from baton.serve.core.token_tree import chain_parents, clear_speculation, tree_depths
from baton.serve.grammar import mask_row
from baton.serve.runner.model_runner import ModelRunner
from baton.serve.sampler import SampleResult, _has_penalties, logprobs_of, target_distribution, target_distributions
from baton.serve.scheduling.block_manager import BlockManager
from baton.serve.speculative.base import Proposer
from baton.serve.speculative.config import AdaptiveK, SpecStats, SpeculativeConfig


def choose(p: torch.Tensor, candidates: list[int], q: torch.Tensor | None, generator, greedy: bool) -> tuple[int, int]:
    """Pick the next token given the target distribution p and proposed candidates.
    Returns (token, index of the accepted candidate or -1)."""
    if greedy:
        token = int(torch.argmax(p))
        return token, candidates.index(token) if token in candidates else -1
    p = p.clone()
    for i, c in enumerate(candidates):
        qc = q[i] if q is not None else torch.zeros_like(p).index_fill_(0, torch.tensor([c]), 1.0)
        if float(torch.rand((), generator=generator)) * float(qc[c]) < float(p[c]):  # u < p/q
            return c, i
        p = torch.clamp(p - qc, min=0)
        total = p.sum()
        if total <= 0:  # p was entirely covered by q: any residual choice is measure-zero
            return c, i
        p = p / total
    return int(torch.multinomial(p, 1, generator=generator)), -1


class SpeculativeDecoder:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        runner: ModelRunner,
        block_manager: BlockManager,
        max_model_len: int,
    ):
        self.config, self.proposer = config, proposer
        self.runner, self.bm = runner, block_manager
        self.max_model_len = max_model_len
        proposer.max_model_len = max_model_len
        proposer.bind(runner, block_manager)
        self.stats = SpecStats()
        self.decode_steps = 0  # steps with sequences to propose for (speedup_probe_every counts them)
        k = config.lookahead_ngram - 1 if config.method == "lookahead" else config.num_speculative_tokens
        self.adaptive_k = AdaptiveK(k, config.adaptive)

    @property
    def wants_hidden(self) -> bool:
        """Whether the forward must return the final hidden states of the sampled rows."""
        return self.proposer.wants_hidden

    def propose(self, running: list[Sequence], inject: FaultInjector | None, fail: SequenceFailure) -> None:
        """Proposals for the running sequences that decode next; a raise fails that request only."""
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        limit, probe = self.config.disable_above_batch, self.config.speedup_probe_every
        if not decoding or (limit is not None and len(running) > limit):
            return
        self.decode_steps += 1
        if probe is not None and self.decode_steps % probe == 0:
            return  # a plain step: the speed-up's baseline at this batch size
        budget = self.max_model_len - 1
        ks = {
            s.seq_id: min(self.adaptive_k.k(s), s.params.max_tokens - s.num_output_tokens - 1, budget - s.num_tokens)
            for s in decoding
        }
        ready = [s for s in decoding if ks[s.seq_id] > 0]
        if ready:
            propose = lambda b: self.proposer.propose(b, ks) or [None] * len(b)  # noqa: E731
            per_sequence("propose", ready, propose, inject, fail)

    def decode_step_kind(self, scheduled: list[tuple[Sequence, int]]) -> bool | None:
        """After the schedule, for the speed-up's step timing: None unless every scheduled sequence
        decodes (a prefill chunk would be in the step's time), else whether any verifies proposals."""
        if not scheduled or any(s.num_tokens - s.num_computed_tokens != 1 for s, _ in scheduled):
            return None
        return any(s.spec_token_ids for s, _ in scheduled)

    def verify(
        self, seq: Sequence, logits: torch.Tensor, hidden: torch.Tensor | None, append: Callable[[SampleResult], None]
    ) -> None:
        """Accept the longest verified path of seq's proposals, given the logits (and hidden states)
        of its rows in the forward: root first, then one row per proposal. `append` adds a token
        to seq (and may finish it)."""
        window = self.proposer.window_rows(seq)  # trailing rows that are not candidates (lookahead)
        proposals = seq.spec_token_ids[: len(seq.spec_token_ids) - window]
        parents = seq.spec_parents if seq.spec_parents is not None else chain_parents(len(proposals))
        parents = parents[: len(proposals)]
        draft_probs = seq.spec_draft_probs
        clear_speculation(seq)
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents):
            children.setdefault(parent, []).append(i)
        logits = logits.float().cpu()
        # without a grammar or penalties a row's distribution does not depend on the tokens kept
        # before it along the path: every row's at once, one sampler call instead of one per row
        rows = (
            None
            if seq.grammar is not None or _has_penalties(seq.params)
            else target_distributions(logits, [seq] * len(logits))
        )
        root_slot_index = seq.num_computed_tokens - seq.num_evicted_tokens
        seq.num_computed_tokens += 1  # the last real token's K/V is now cached
        node, path = -1, []
        while True:
            kids = children.get(node, [])
            row = mask_row(logits[node + 1], seq)  # structured outputs: the grammar's mask here
            p = target_distribution(row, seq) if rows is None else rows[node + 1]
            q = draft_probs[kids] if draft_probs is not None and kids else None
            token, idx = choose(p, [proposals[i] for i in kids], q, seq.generator, seq.params.greedy)
            append(SampleResult(token, logprobs_of(row, token, seq.params.logprobs)))
            if idx < 0 or seq.is_finished:
                break
            node = kids[idx]
            path.append(node)
            seq.num_computed_tokens += 1  # the accepted proposal's K/V is valid
        self.stats.count(len(proposals), max(tree_depths(parents), default=0), len(path))
        if not seq.is_finished:  # a finished sequence was already released (its rate forgotten)
            self.adaptive_k.update(seq, len(proposals), len(path))
            if window:
                self.proposer.window_logits(seq, logits[len(logits) - window :])
        if not seq.is_finished:
            bs = self.bm.block_size
            slot = lambda c: seq.block_table[c // bs] * bs + c % bs  # noqa: E731
            moves = [(root_slot_index + 1 + n, root_slot_index + 1 + d) for d, n in enumerate(path) if n != d]
            src, dst = [a for a, _ in moves], [b for _, b in moves]
            slots = [[slot(c) for c in src], [slot(c) for c in dst]]
            if seq.window_block_table is not None:  # KV groups: the sliding-window layers' own table
                wslot = lambda c: seq.window_block_table[c // bs] * bs + c % bs  # noqa: E731
                slots += [[wslot(c) for c in src], [wslot(c) for c in dst]]
            self.runner.move_slots(*slots)
            self.bm.trim(seq)
            self.bm.register_full_blocks(seq)
            if hidden is not None:
                # the root's row and each accepted proposal's; the last one gave the last token
                self.proposer.observe_path(seq, hidden[[0] + [n + 1 for n in path]])

    def observe(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """A plain (not speculative) step's hidden state for these sequences' next token (wants_hidden)."""
        for seq in seqs:
            self.proposer.observe(seq, hidden)

    def release(self, seq: Sequence) -> None:
        """seq left the engine (finished, aborted or failed)."""
        self.proposer.release(seq)
        self.adaptive_k.forget(seq)
