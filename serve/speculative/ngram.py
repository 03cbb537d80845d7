"""Prompt lookup (n-gram) proposals: copy what followed the last occurrence of the current suffix."""

from __future__ import annotations

import numpy as np
from baton.serve.core.sequence import Sequence
from baton.serve.speculative.base import Proposer
from baton.serve.speculative.config import SpeculativeConfig


class NgramProposer(Proposer):
    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg

    def propose(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        for seq in seqs:
            toks = np.asarray(seq.token_ids)
            for n in range(min(self.cfg.ngram_max, len(toks) - 1), self.cfg.ngram_min - 1, -1):
                windows = np.lib.stride_tricks.sliding_window_view(toks[:-1], n)
                hits = np.nonzero((windows == toks[-n:]).all(axis=1))[0]
                if len(hits):
                    start = int(hits[-1]) + n
                    seq.spec_token_ids = toks[start : start + ks[seq.seq_id]].tolist()
                    break
