"""A sequence's proposals as a token tree (a chain is a tree with one path).

seq.spec_token_ids holds the proposals and seq.spec_parents each one's parent (-1: the last real
token; None: a chain). The proposers build trees here: ScoredTree (EAGLE-2's dynamic tree over
the draft's or the Medusa heads' top-k, expanded and reranked by cumulative probability),
choice_tree (a fixed Medusa topology, `medusa_choices`), trie (n-gram guesses sharing prefixes).
How the engine reads a tree (positions, attention mask, trimming) is serve/core/token_tree.py's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch


@dataclass
class ScoredTree:
    """EAGLE-2's dynamic tree (Li et al., 2024): a node's score is the log of its path's cumulative
    draft probability. Each depth expands the `width` best nodes of the previous depth by their
    `width` most likely children; `select` keeps the `budget` best nodes overall. A path's score
    only falls with depth, so the best nodes form a tree (ties go to the shallower node)."""

    width: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def expand(self, parent: int, probs: torch.Tensor) -> list[int]:
        """Add parent's (-1: the root) `width` most likely children; returns their indices."""
        base = self.scores[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        top = torch.topk(probs.float(), min(self.width, probs.numel()))
        added = []
        for p, tok in zip(top.values.tolist(), top.indices.tolist()):
            if p <= 0:
                break
            added.append(len(self.tokens))
            self.tokens.append(int(tok))
            self.parents.append(parent)
            self.scores.append(base + math.log(p))
            self.depths.append(depth)
        return added

    def frontier(self, nodes: list[int]) -> list[int]:
        """The `width` best of `nodes`: the ones the next depth expands."""
        return sorted(nodes, key=lambda i: -self.scores[i])[: self.width]

    def select(self, budget: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the `budget` best nodes, parents before children."""
        best = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depths[i]))[:budget]
        keep = set(best)
        for i in best:  # (float ties could drop an ancestor: keep the tree closed)
            while (i := self.parents[i]) >= 0:
                keep.add(i)
        order = sorted(keep, key=lambda i: (self.depths[i], i))
        index = {old: new for new, old in enumerate(order)}
        return [self.tokens[i] for i in order], [index.get(self.parents[i], -1) for i in order]


def parse_choices(text: str) -> list[tuple[int, ...]]:
    """A Medusa topology from JSON, e.g. "[[0], [1], [0, 0]]": each path lists the top-k rank taken
    at each depth (head). Raises ValueError unless every path's prefix is a path too."""
    try:
        paths = [tuple(int(i) for i in p) for p in json.loads(text)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"tree_choices must be a JSON list of lists of ranks, got {text!r}") from e
    if not paths or any(not p or min(p) < 0 for p in paths) or len(set(paths)) != len(paths):
        raise ValueError(f"tree_choices needs distinct non-empty paths of ranks >= 0, got {text!r}")
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in set(paths)]
    if missing:
        raise ValueError(f"tree_choices: the parent of path {list(missing[0])} is not a path")
    return sorted(paths, key=lambda p: (len(p), p))


def choice_tree(paths: list[tuple[int, ...]], top: list[list[int]]) -> tuple[list[int], list[int]]:
    """Tokens and parents of a fixed topology (parse_choices' order), top[d] being depth d's
    ranked candidates (Medusa head d's top-k): the Cartesian product pruned to the listed paths."""
    index: dict[tuple[int, ...], int] = {}
    tokens, parents = [], []
    for path in paths:
        d = len(path) - 1
        if d >= len(top) or path[-1] >= len(top[d]) or (d and path[:-1] not in index):
            continue  # deeper than this step proposes (or a pruned parent)
        index[path] = len(tokens)
        tokens.append(top[d][path[-1]])
        parents.append(index[path[:-1]] if d else -1)
    return tokens, parents


def trie(chains: list[list[int]]) -> tuple[list[int], list[int]]:
    """The chains as one tree, common prefixes shared (n-gram guesses often share their start)."""
    node: dict[tuple[int, int], int] = {}  # (parent, token) -> index
    tokens, parents = [], []
    for chain in chains:
        parent = -1
        for tok in chain:
            if (parent, tok) not in node:
                node[parent, tok] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
            parent = node[parent, tok]
    return tokens, parents
