"""Proposers: each sets seq.spec_token_ids for the sequences it is given (seq.spec_parents for a
token tree, seq.spec_draft_probs when it sampled them); serve/speculative/__init__.py lists them."""

from __future__ import annotations

import itertools
from pathlib import Path
import numpy as np
import torch

from baton.serve.block_manager import BlockManager
from baton.serve.model_runner import ModelRunner
from baton.serve.sampler import target_distribution
from baton.serve.sequence import Sequence
from baton.serve.speculative.config import SpeculativeConfig
from baton.serve.speculative.tree import ScoredTree, choice_tree, clear_speculation, parse_choices


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


class DraftProposer(Proposer):
    """The draft keeps a mirror of each target sequence in its own paged cache; after each
    verification the mirror is rolled back to the longest prefix it shares with the target.
    A chain samples k tokens from the draft; a tree (tree_width > 1) is EAGLE-2's dynamic tree
    over the draft's top-k (tree.py, ScoredTree): one draft pass per depth over the whole tree so
    far, each node attending to its ancestors only."""

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
        if self.cfg.tree_width > 1:
            return self._propose_tree(seqs, ks)
        pairs = [(s, self._mirror(s)) for s in seqs]
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
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
        for s, m in pairs:
            if len(m.token_ids) > s.num_tokens:
                s.spec_token_ids = m.token_ids[s.num_tokens :]
                s.spec_draft_probs = None if s.params.greedy else torch.stack(probs[s.seq_id])

    def _propose_tree(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        """Depth 1 from the pass that catches the mirror up; depth d + 1 from a pass over the root
        (recomputed, so it is the one pending token) and the tree's nodes up to depth d."""
        trees: dict[int, ScoredTree] = {}
        frontier: dict[int, list[int]] = {}
        batch = []
        for s in seqs:
            m = self._mirror(s)
            n = m.num_tokens - m.num_computed_tokens
            if self.bm.allocate_slots(m, n):
                batch.append((s, m, n))
        if not batch:
            return
        self.runner.apply_block_ops(self.bm.take_pending())
        logits = self.runner.execute([(m, n) for _, m, n in batch]).logits.float().cpu()
        for (s, m, n), row in zip(batch, logits):
            m.num_computed_tokens += n
            trees[s.seq_id] = ScoredTree(self.cfg.tree_width)
            frontier[s.seq_id] = trees[s.seq_id].expand(-1, torch.softmax(row, -1))
        live = [(s, m) for s, m, _ in batch]
        for depth in range(1, max(ks[s.seq_id] for s, _ in live)):
            step = []
            for s, m in live:
                t = trees[s.seq_id]
                if depth >= ks[s.seq_id] or not frontier[s.seq_id]:
                    continue
                m.num_computed_tokens -= 1
                m.spec_token_ids, m.spec_parents = list(t.tokens), list(t.parents)
                if self.bm.allocate_slots(m, 1 + len(t.tokens)):
                    step.append((s, m))
                else:
                    m.num_computed_tokens += 1
                    clear_speculation(m)
            if not step:
                break
            self.runner.apply_block_ops(self.bm.take_pending())
            result = self.runner.execute([(m, 1 + len(m.spec_token_ids)) for _, m in step])
            rows = result.logits.float().cpu()
            at = 0
            for s, m in step:
                t, size = trees[s.seq_id], 1 + len(m.spec_token_ids)
                probs = torch.softmax(rows[at : at + size], -1)
                at += size
                new = [c for i in t.frontier(frontier[s.seq_id]) for c in t.expand(i, probs[i + 1])]
                frontier[s.seq_id] = new
                m.num_computed_tokens += 1
                clear_speculation(m)
                self.bm.trim(m)  # the tree's slots: the next pass writes them again
        for s, _ in live:
            s.spec_token_ids, s.spec_parents = trees[s.seq_id].select(self.cfg.node_budget)

    def release(self, seq: Sequence) -> None:
        m = self.mirrors.pop(seq.seq_id, None)
        if m is not None:
            self.bm.free(m)


class MedusaProposer(Proposer):
    """Top-k of each Medusa head, read from the hidden state that produced the last token. A tree
    is their Cartesian product (head d's candidates at depth d + 1), either a fixed topology
    (tree_choices, Medusa's `medusa_choices`) or EAGLE-2's dynamic rule by the product of the
    heads' probabilities along the path (tree_width, tree_nodes)."""

    wants_hidden = True

    def __init__(self, cfg: SpeculativeConfig, model_dir: str | Path, device, dtype):
        from baton.common.medusa import load_medusa

        self.cfg = cfg
        self.heads = load_medusa(model_dir, device, dtype)
        self.hidden: dict[int, torch.Tensor] = {}
        self.choices = parse_choices(cfg.tree_choices) if cfg.tree_choices is not None else None
        num_heads = len(self.heads.heads)
        if self.choices is not None and max(len(p) for p in self.choices) > num_heads:
            raise ValueError(f"tree_choices goes deeper than the checkpoint's {num_heads} Medusa heads")

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        self.hidden[seq.seq_id] = hidden

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        ready = [s for s in seqs if s.seq_id in self.hidden]
        if not ready:
            return
        logits = self.heads(torch.stack([self.hidden[s.seq_id] for s in ready])).float().cpu()  # [heads, B, V]
        width = max(self.cfg.tree_width, 1 + max((max(p) for p in self.choices or [(0,)])))
        top = torch.topk(logits, width, dim=-1).indices  # [heads, B, width]
        for b, s in enumerate(ready):
            depth = min(ks[s.seq_id], logits.shape[0])
            if self.choices is not None:
                s.spec_token_ids, s.spec_parents = choice_tree(self.choices, [top[h, b].tolist() for h in range(depth)])
            elif width == 1:
                s.spec_token_ids = top[:depth, b, 0].tolist()
            else:
                s.spec_token_ids, s.spec_parents = self._dynamic(torch.softmax(logits[:depth, b], -1))

    def _dynamic(self, probs: torch.Tensor) -> tuple[list[int], list[int]]:
        """probs [depth, V]: every node at depth d has head d's candidates as children."""
        t = ScoredTree(self.cfg.tree_width)
        frontier = t.expand(-1, probs[0])
        for d in range(1, probs.shape[0]):
            frontier = [c for i in t.frontier(frontier) for c in t.expand(i, probs[d])]
        return t.select(self.cfg.node_budget)

    def release(self, seq: Sequence) -> None:
        self.hidden.pop(seq.seq_id, None)


def make_proposer(
    cfg: SpeculativeConfig,
    model_dir: str | Path | None,
    vocab: int,
    device: torch.device,
    dtype: torch.dtype,
    model: torch.nn.Module | None = None,
) -> Proposer:
    """`model`: the engine's own model, when this process holds it (layerskip drafts with it)."""
    cfg.validate()
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if cfg.method == "draft":
        return DraftProposer(cfg, vocab, device, dtype)  # the draft runs where the target runs
    if cfg.method == "lookahead":
        from baton.serve.speculative.lookahead import LookaheadProposer

        return LookaheadProposer(cfg)
    if cfg.method == "layerskip":
        from baton.serve.speculative.layerskip import LayerSkipProposer

        return LayerSkipProposer(cfg, model, model_dir, device, dtype)
    if cfg.method == "eagle":
        from baton.serve.speculative.eagle import EagleProposer

        if model_dir is None:
            raise ValueError("EAGLE needs the checkpoint directory holding eagle.safetensors")
        return EagleProposer(cfg, model_dir, device, dtype)
    if model_dir is None:
        raise ValueError("Medusa needs the checkpoint directory holding medusa.safetensors")
    return MedusaProposer(cfg, model_dir, device, dtype)
