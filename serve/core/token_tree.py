"""The shape of a sequence's speculative proposals, as every part of the engine reads it.

seq.spec_token_ids holds the proposals and seq.spec_parents each one's parent (-1: the last real
token; None: a chain). The model runner packs a tree into the verification pass (tree_depths for
RoPE positions, ancestor_mask for attention); the scheduler trims proposals to a step's token
budget (clear_speculation); the decoder walks the tree (chain_parents). How proposers build trees
is serve/speculative/tree.py's.
"""

from __future__ import annotations

import torch
from baton.serve.core.sequence import Sequence


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def tree_depths(parents: list[int]) -> list[int]:
    """Depth (1 = child of the last real token) of each proposal; parents precede children."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n+1, n+1] bool: row i may attend column j iff j is i or an ancestor (row/col 0 = root)."""
    n = len(parents) + 1
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents, start=1):
        if p >= 0:
            mask[i] |= mask[p + 1]
    return mask


def clear_speculation(seq: Sequence, keep: int = 0) -> None:
    """Drop proposals beyond the first `keep` (a tree is kept whole or dropped)."""
    if keep == 0 or seq.spec_parents is not None:
        seq.spec_token_ids, seq.spec_parents, seq.spec_draft_probs = [], None, None
    else:
        del seq.spec_token_ids[keep:]
        if seq.spec_draft_probs is not None:
            seq.spec_draft_probs = seq.spec_draft_probs[:keep]
