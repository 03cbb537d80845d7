"""Draft-model proposals: a small model with its own paged KV cache proposes k tokens, a chain or
EAGLE-2's dynamic tree over the draft's top-k."""

from __future__ import annotations

import itertools

import torch
from baton.serve.core.sequence import Sequence
from baton.serve.core.token_tree import clear_speculation
from baton.serve.runner.model_runner import ModelRunner
from baton.serve.sampler import target_distribution
from baton.serve.scheduling.block_manager import BlockManager
from baton.serve.speculative.base import Proposer
from baton.serve.speculative.config import SpeculativeConfig
from baton.serve.speculative.tree import ScoredTree


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
