"""Medusa proposals: heads on the target's last hidden state, a chain, or a tree from the Cartesian
product of the heads' top-k (or a fixed topology, tree_choices)."""

from __future__ import annotations

from pathlib import Path

import torch
from baton.serve.core.sequence import Sequence
from baton.serve.speculative.base import Proposer
from baton.serve.speculative.config import SpeculativeConfig
from baton.serve.speculative.tree import ScoredTree, choice_tree, parse_choices


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
