"""Speculative decoding: cheap proposals, one target pass to verify them, exact output.

Proposers (each sets seq.spec_token_ids, and seq.spec_parents for a tree):
  * NgramProposer   - prompt lookup: copy what followed the last occurrence of the current suffix
  * DraftProposer   - a small model with its own paged KV cache proposes k tokens (a chain, or a
                      SpecInfer-style tree with the draft's top alternatives at each depth)
  * MedusaProposer  - Medusa heads on the target's last hidden state propose a token tree

Verification keeps the target's distribution exactly. At each node the candidates (children)
are tried in turn with rejection sampling: accept c with probability min(1, p(c)/q(c)), else
continue with the residual norm(max(p - q, 0)) (q is one-hot for deterministic proposals, which
makes this SpecInfer's multi-candidate rule); when no candidate is accepted the token is drawn
from the final residual. Greedy requests accept exactly the argmax. (Leviathan et al., 2023;
Chen et al., 2023; Miao et al., 2023.)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from baton.serve.block_manager import BlockManager
from baton.serve.model_runner import ModelRunner
from baton.serve.sampler import target_distribution
from baton.serve.sequence import Sequence

METHODS = ("ngram", "draft", "medusa")


@dataclass
class SpeculativeConfig:
    method: str  # "ngram" | "draft" | "medusa"
    num_speculative_tokens: int = 4  # k (the most; adaptive k may use fewer)
    draft_model: str | None = None  # checkpoint dir, for method "draft"
    draft_kv_cache_bytes: int = 64 * 1024**2
    tree_width: int = 1  # >1: a token tree with this many alternatives at each depth
    ngram_max: int = 4
    ngram_min: int = 1
    adaptive: bool = False  # adapt k per sequence from its running acceptance rate
    disable_above_batch: int | None = None  # no speculation while more sequences than this decode

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (a checkpoint directory)")
        if self.disable_above_batch is not None and self.disable_above_batch < 1:
            raise ValueError(f"disable_above_batch must be >= 1 (or None), got {self.disable_above_batch}")
        if self.tree_width < 1 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need tree_width >= 1 and 1 <= ngram_min <= ngram_max")


@dataclass
class SpecStats:
    steps: int = 0  # verification passes
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification pass (accepted proposals + the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


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


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def top_tree(candidates: list[list[int]]) -> tuple[list[int], list[int]]:
    """A tree from per-depth candidate lists: the first candidate of each depth continues the
    main chain, the others are leaf alternatives. Returns (tokens, parents)."""
    tokens, parents, tip = [], [], -1
    for cands in candidates:
        for j, tok in enumerate(cands):
            tokens.append(tok)
            parents.append(tip)
            if j == 0:
                main = len(tokens) - 1
        tip = main
    return tokens, parents


# ------------------------------------------------------------------------------------ proposers
class NgramProposer:
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
                    seq.spec_token_ids = toks[start:start + ks[seq.seq_id]].tolist()
                    break

    def release(self, seq: Sequence) -> None:
        pass


class DraftProposer:
    """The draft keeps a mirror of each target sequence in its own paged cache; after each
    verification the mirror is rolled back to the longest prefix it shares with the target."""

    def __init__(self, cfg: SpeculativeConfig, target_vocab: int):
        from baton.common.checkpoint import load_checkpoint

        self.cfg = cfg
        draft = load_checkpoint(cfg.draft_model).model
        if draft.config.vocab_size != target_vocab:
            raise ValueError(f"draft model vocab {draft.config.vocab_size} != target vocab {target_vocab}: "
                             "the draft must share the target's tokenizer")
        block_size = 16
        elem = next(draft.parameters()).element_size()
        c = draft.config
        block_bytes = 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * elem
        num_blocks = max(4, cfg.draft_kv_cache_bytes // block_bytes)
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(draft, num_blocks, block_size)
        self.mirrors: dict[int, Sequence] = {}
        self._ids = itertools.count()

    def _mirror(self, seq: Sequence) -> Sequence:
        m = self.mirrors.get(seq.seq_id)
        if m is None:
            m = Sequence(next(self._ids), seq.request_id, seq.index, seq.prompt_token_ids, seq.params)
            if seq.params.seed is not None:
                # a stream apart from the target's (seed + index); mod 2**64 keeps any int64 seed in range
                m.generator = torch.Generator().manual_seed((seq.params.seed * 7919 + seq.index + 1) % 2**64)
            self.mirrors[seq.seq_id] = m
        common = next((i for i, (a, b) in enumerate(zip(m.token_ids, seq.token_ids)) if a != b),
                      min(len(m.token_ids), len(seq.token_ids)))
        m.token_ids = list(seq.token_ids)
        m.num_computed_tokens = min(m.num_computed_tokens, common, len(m.token_ids) - 1)
        self.bm.trim(m)
        return m

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        pairs = [(s, self._mirror(s)) for s in seqs]
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        alts: dict[int, list[list[int]]] = {s.seq_id: [] for s in seqs}
        active = list(pairs)
        for depth in range(max(ks.values(), default=0)):
            batch = []
            for s, m in list(active):
                n = m.num_tokens - m.num_computed_tokens
                if depth >= ks[s.seq_id] or not self.bm.allocate_slots(m, n):
                    active.remove((s, m))
                    continue
                batch.append((s, m, n))
            if not batch:
                break
            self.runner.apply_block_ops(*self.bm.take_pending())
            logits, _ = self.runner.execute([(m, n) for _, m, n in batch])
            for (s, m, n), row in zip(batch, logits.float().cpu()):
                m.num_computed_tokens += n
                q = target_distribution(row, m)
                token = int(torch.argmax(q)) if m.params.greedy else int(torch.multinomial(q, 1, generator=m.generator))
                m.token_ids.append(token)
                probs[s.seq_id].append(q)
                if self.cfg.tree_width > 1:
                    others = [int(t) for t in torch.topk(row, self.cfg.tree_width + 1).indices if int(t) != token]
                    alts[s.seq_id].append([token] + others[:self.cfg.tree_width - 1])
        for s, m in pairs:
            if len(m.token_ids) <= s.num_tokens:
                continue
            if self.cfg.tree_width > 1:
                s.spec_token_ids, s.spec_parents = top_tree(alts[s.seq_id])
            else:
                s.spec_token_ids = m.token_ids[s.num_tokens:]
                s.spec_draft_probs = None if s.params.greedy else torch.stack(probs[s.seq_id])

    def release(self, seq: Sequence) -> None:
        m = self.mirrors.pop(seq.seq_id, None)
        if m is not None:
            self.bm.free(m)


class MedusaProposer:
    """Top-k of each Medusa head, read from the hidden state that produced the last token."""

    def __init__(self, cfg: SpeculativeConfig, model_dir: str | Path, device, dtype):
        from baton.common.medusa import load_medusa

        self.cfg = cfg
        self.heads = load_medusa(model_dir, device, dtype)
        self.hidden: dict[int, torch.Tensor] = {}
        self.wants_hidden = True

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        self.hidden[seq.seq_id] = hidden

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        ready = [s for s in seqs if s.seq_id in self.hidden]
        if not ready:
            return
        logits = self.heads(torch.stack([self.hidden[s.seq_id] for s in ready]))  # [heads, B, V]
        width = self.cfg.tree_width
        top = torch.topk(logits, width, dim=-1).indices  # [heads, B, width]
        for b, s in enumerate(ready):
            depth = min(ks[s.seq_id], logits.shape[0])
            cands = [top[h, b].tolist() for h in range(depth)]
            if width == 1:
                s.spec_token_ids = [c[0] for c in cands]
            else:
                s.spec_token_ids, s.spec_parents = top_tree(cands)

    def release(self, seq: Sequence) -> None:
        self.hidden.pop(seq.seq_id, None)


@dataclass
class AdaptiveK:
    """k from the running acceptance rate a: the expected run of accepted tokens is a/(1-a)."""

    k_max: int
    enabled: bool
    rates: dict[int, float] = field(default_factory=dict)

    def k(self, seq: Sequence) -> int:
        if not self.enabled:
            return self.k_max
        a = self.rates.get(seq.seq_id, 0.7)
        return max(1, min(self.k_max, round(a / max(1e-3, 1 - a)) + 1))

    def update(self, seq: Sequence, proposed: int, accepted: int) -> None:
        if proposed:
            self.rates[seq.seq_id] = 0.7 * self.rates.get(seq.seq_id, 0.7) + 0.3 * accepted / proposed

    def forget(self, seq: Sequence) -> None:
        self.rates.pop(seq.seq_id, None)


def make_proposer(cfg: SpeculativeConfig, model_dir: str | Path | None, vocab: int, device, dtype):
    cfg.validate()
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if cfg.method == "draft":
        return DraftProposer(cfg, vocab)
    if model_dir is None:
        raise ValueError("Medusa needs the checkpoint directory holding medusa.safetensors")
    return MedusaProposer(cfg, model_dir, device, dtype)
