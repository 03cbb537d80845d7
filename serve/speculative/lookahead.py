"""Lookahead decoding (Fu et al., 2024): Jacobi iteration as a source of n-gram guesses.

Each sequence keeps a 2D window of guessed tokens, N - 1 levels of W positions: a Jacobi
trajectory. Level 0's token j sits j + 1 places after the last real token, level l's l places
further on. The window rides along in the verification pass as extra nodes of the token tree
(serve/speculative/tree.py packs them; serve/runner/attention.py masks them): level 0 is a chain, and
level l's token j hangs under level l - 1's token j, so every window token attends to the cached
prefix, the root, and the tokens before it on its own diagonal - the lookahead branch's mask.
The target's prediction after the newest level's token j is one more Jacobi step; each step
drops the oldest level, and the diagonal (level 0 token j, ..., level N - 2 token j, the new
prediction) is an n-gram for the pool, keyed by its first token. The pool (also fed with every
n-gram of the sequence's own tokens) offers up to G continuations of the last real token: the
verification branch, a trie of guesses N - 1 deep, checked exactly like any other candidates
(the decoder's rejection rule: exact under greedy and sampling). Window rows are never
candidates: the decoder hands their logits back here (window_rows, window_logits).

Cost: one target pass per step, wider by W x (N - 1) window rows plus the guesses' nodes; no
draft model. Constrained (structured-output) sequences get the guesses without the window.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from baton.serve.core.sequence import Sequence
from baton.serve.speculative.base import Proposer
from baton.serve.speculative.config import SpeculativeConfig
from baton.serve.speculative.tree import trie


@dataclass
class _Lookahead:
    levels: list[list[int]]  # Jacobi trajectory, oldest level first; W tokens each
    pool: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # first token -> continuations
    indexed: int = 0  # the sequence's own n-grams starting before this index are in the pool
    window: int = 0  # window rows at the end of this step's proposals


class LookaheadProposer(Proposer):
    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self.W, self.N, self.G = cfg.lookahead_window, cfg.lookahead_ngram, cfg.lookahead_guesses
        self.state: dict[int, _Lookahead] = {}

    def _state(self, seq: Sequence) -> _Lookahead:
        st = self.state.get(seq.seq_id)
        if st is None:  # level 0: tokens drawn from the context (the Jacobi start may be anything)
            rng = random.Random(seq.seq_id)
            st = self.state[seq.seq_id] = _Lookahead([[rng.choice(seq.token_ids) for _ in range(self.W)]])
        toks = seq.token_ids
        for i in range(st.indexed, len(toks) - self.N + 1):
            self._add(st, toks[i], tuple(toks[i + 1 : i + self.N]))
        st.indexed = max(st.indexed, len(toks) - self.N + 1)
        return st

    def _add(self, st: _Lookahead, key: int, ngram: tuple[int, ...]) -> None:
        """Most recent first, at most G continuations a key."""
        cont = st.pool.setdefault(key, [])
        if ngram in cont:
            cont.remove(ngram)
        cont.insert(0, ngram)
        del cont[self.G :]

    def propose(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        for seq in seqs:
            st = self._state(seq)
            depth = min(ks[seq.seq_id], self.N - 1)
            guesses = [list(g[:depth]) for g in st.pool.get(seq.token_ids[-1], [])]
            tokens, parents = trie(guesses)
            levels, W = len(st.levels), self.W
            fits = seq.num_tokens + 1 + len(tokens) + levels * W <= self.max_model_len
            st.window = levels * W if fits and getattr(seq, "grammar", None) is None else 0
            if st.window:
                base = len(tokens)
                for lvl, row in enumerate(st.levels):
                    for j, tok in enumerate(row):
                        tokens.append(tok)
                        if lvl:
                            parents.append(base + (lvl - 1) * W + j)
                        else:
                            parents.append(base + j - 1 if j else -1)
            if tokens:
                seq.spec_token_ids, seq.spec_parents = tokens, parents

    def window_rows(self, seq: Sequence) -> int:
        st = self.state.get(seq.seq_id)
        return st.window if st is not None else 0

    def window_logits(self, seq: Sequence, logits: torch.Tensor) -> None:
        """One Jacobi step: the prediction after each newest-level token is the next level."""
        st = self.state.get(seq.seq_id)
        if st is None or not st.window:
            return
        new = logits[-self.W :].argmax(-1).tolist()
        if len(st.levels) == self.N - 1:
            for j in range(self.W):
                self._add(st, st.levels[0][j], tuple(lvl[j] for lvl in st.levels[1:]) + (new[j],))
            st.levels.pop(0)
        st.levels.append(new)

    def release(self, seq: Sequence) -> None:
        self.state.pop(seq.seq_id, None)
