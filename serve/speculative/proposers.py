"""Proposers: each sets seq.spec_token_ids for the sequences it is given (seq.spec_parents for a
token tree, seq.spec_draft_probs when it sampled them); serve/speculative/__init__.py lists them."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from baton.serve.block_manager import BlockManager
from baton.serve.model_runner import ModelRunner
from baton.serve.sampler import target_distribution
from baton.serve.sequence import Sequence
from baton.serve.speculative.config import SpeculativeConfig
from baton.serve.speculative.tree import top_tree


class Proposer(Protocol):
    """A proposal method, as the decoder drives it."""

    wants_hidden: bool  # True: observe() is given the target's final hidden state of each new token (Medusa)

    def propose(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        """Propose at most ks[seq.seq_id] tokens deep for each sequence (or nothing)."""

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """The hidden state that produced seq's last token (only when wants_hidden)."""

    def release(self, seq: Sequence) -> None:
        """seq is done (finished, aborted or failed): drop what is kept for it."""


class NgramProposer:
    wants_hidden = False

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

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


class DraftProposer:
    """The draft keeps a mirror of each target sequence in its own paged cache; after each
    verification the mirror is rolled back to the longest prefix it shares with the target."""

    wants_hidden = False

    def __init__(
        self,
        cfg: SpeculativeConfig,
        target_vocab: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ):
        """The draft is loaded onto the target's device, in the target's dtype when that is a float
        one (a float checkpoint converts; None keeps the checkpoint's own dtype)."""
        from baton.common.checkpoint import load_checkpoint

        self.cfg = cfg
        float_dtype = dtype if dtype is not None and dtype.is_floating_point else None
        draft = load_checkpoint(cfg.draft_model, device=device, dtype=float_dtype).model
        if draft.config.vocab_size != target_vocab:
            raise ValueError(
                f"draft model vocab {draft.config.vocab_size} != target vocab {target_vocab}: "
                "the draft must share the target's tokenizer"
            )
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
        common = next(
            (i for i, (a, b) in enumerate(zip(m.token_ids, seq.token_ids)) if a != b),
            min(len(m.token_ids), len(seq.token_ids)),
        )
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
            self.runner.apply_block_ops(self.bm.take_pending())
            logits = self.runner.execute([(m, n) for _, m, n in batch]).logits
            for (s, m, n), row in zip(batch, logits.float().cpu()):
                m.num_computed_tokens += n
                q = target_distribution(row, m)
                token = int(torch.argmax(q)) if m.params.greedy else int(torch.multinomial(q, 1, generator=m.generator))
                m.token_ids.append(token)
                probs[s.seq_id].append(q)
                if self.cfg.tree_width > 1:
                    others = [int(t) for t in torch.topk(row, self.cfg.tree_width + 1).indices if int(t) != token]
                    alts[s.seq_id].append([token] + others[: self.cfg.tree_width - 1])
        for s, m in pairs:
            if len(m.token_ids) <= s.num_tokens:
                continue
            if self.cfg.tree_width > 1:
                s.spec_token_ids, s.spec_parents = top_tree(alts[s.seq_id])
            else:
                s.spec_token_ids = m.token_ids[s.num_tokens :]
                s.spec_draft_probs = None if s.params.greedy else torch.stack(probs[s.seq_id])

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        m = self.mirrors.pop(seq.seq_id, None)
        if m is not None:
            self.bm.free(m)


class MedusaProposer:
    """Top-k of each Medusa head, read from the hidden state that produced the last token."""

    wants_hidden = True

    def __init__(self, cfg: SpeculativeConfig, model_dir: str | Path, device, dtype):
        from baton.common.medusa import load_medusa

        self.cfg = cfg
        self.heads = load_medusa(model_dir, device, dtype)
        self.hidden: dict[int, torch.Tensor] = {}

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


def make_proposer(
    cfg: SpeculativeConfig, model_dir: str | Path | None, vocab: int, device: torch.device, dtype: torch.dtype
) -> Proposer:
    cfg.validate()
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if cfg.method == "draft":
        return DraftProposer(cfg, vocab, device, dtype)  # the draft runs where the target runs
    if model_dir is None:
        raise ValueError("Medusa needs the checkpoint directory holding medusa.safetensors")
    return MedusaProposer(cfg, model_dir, device, dtype)
