"""Proposer: the interface every speculative method implements. Each sets seq.spec_token_ids for
the sequences it is given (seq.spec_parents for a token tree, seq.spec_draft_probs when it sampled
them); serve/speculative/registry.py makes one by name."""

from __future__ import annotations

import torch
from baton.serve.core.sequence import Sequence
from baton.serve.runner.model_runner import ModelRunner
from baton.serve.scheduling.block_manager import BlockManager


class Proposer:
    """A proposal method, as the decoder drives it (the defaults: a proposer that keeps nothing)."""

    wants_hidden = False  # True: observe() is given the target's final hidden state of each new token (Medusa)
    max_model_len = 1 << 62  # the context every proposal's rows must fit in (the decoder sets it)

    def bind(self, runner: ModelRunner, block_manager: BlockManager) -> None:
        """The engine's model runner and block manager (LayerSkip's draft writes its K/V there)."""

    def propose(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        """Propose at most ks[seq.seq_id] tokens deep for each sequence (or nothing)."""
        raise NotImplementedError

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """The hidden state that produced seq's last token (only when wants_hidden)."""

    def observe_path(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """After a verification, hidden [n, H] of the root and each accepted proposal in order (the
        last produced seq's last token; EAGLE keeps them all); by default only the last is observed."""
        self.observe(seq, hidden[-1])

    def window_rows(self, seq: Sequence) -> int:
        """How many of seq's last proposals are not candidates but rows the proposer itself needs
        computed in the verification pass (lookahead's Jacobi window)."""
        return 0

    def window_logits(self, seq: Sequence, logits: torch.Tensor) -> None:
        """The target's logits of those window rows, after verification (seq still running)."""

    def release(self, seq: Sequence) -> None:
        """seq is done (finished, aborted or failed): drop what is kept for it."""
