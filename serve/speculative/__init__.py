"""Speculative decoding: cheap proposals, one target pass to verify them, exact output.

  * base.py      - Proposer, the interface every method implements: each sets seq.spec_token_ids
                   (and seq.spec_parents for a tree); registry.py makes one by name and checks the
                   checkpoint has what the method needs (check_checkpoint), before any work starts
  * ngram.py     - NgramProposer (prompt lookup: copy what followed the last occurrence of the
                   current suffix)
  * draft.py     - DraftProposer (a small model with its own paged KV cache proposes k tokens, a
                   chain or EAGLE-2's dynamic tree over the draft's top-k)
  * medusa.py    - MedusaProposer (Medusa heads on the target's last hidden state: a chain, or a
                   tree from the Cartesian product of the heads' top-k)
  * layerskip.py - LayerSkipProposer: the model's own first E layers (+ final norm and LM head)
                   draft, the full model verifies (LayerSkip self-speculation)
  * eagle.py     - EagleProposer: a trained one-layer EAGLE head drafts from the target's own last
                   hidden states, a chain or EAGLE-2's dynamic tree (the head: common/eagle.py)
  * mtp.py       - MTPProposer: the model's own MTP modules (DeepSeek-V3, baton.common.mtp) draft
                   from its last hidden states, a chain, each module with its own cache
  * lookahead.py - LookaheadProposer: Jacobi iteration trajectories in the verification pass feed
                   an n-gram pool whose guesses are verified (lookahead decoding)
  * decoder.py   - SpeculativeDecoder, what the engine calls: proposals before the schedule,
                   verification after the forward (`choose`), adaptive k and the stats
  * tree.py      - building token trees (dynamic, fixed topology, trie); how the engine reads one
                   (depths, attention mask, trimming) is serve/core/token_tree.py's
  * config.py    - SpeculativeConfig, SpecStats, AdaptiveK

Verification keeps the target's distribution exactly. At each node the candidates (children)
are tried in turn with rejection sampling: accept c with probability min(1, p(c)/q(c)), else
continue with the residual norm(max(p - q, 0)) (q is one-hot for deterministic proposals, which
makes this SpecInfer's multi-candidate rule); when no candidate is accepted the token is drawn
from the final residual. Greedy requests accept exactly the argmax. (Leviathan et al., 2023;
Chen et al., 2023; Miao et al., 2023.)
"""

import importlib

# `baton serve --speculative` offers these, and its --help lists them with these words
METHOD_HELP = {
    "ngram": "prompt lookup: copy what followed the last occurrence of the current suffix",
    "draft": "a small draft model (--draft-model) proposes; a chain, or a tree with --speculative-tree-width",
    "medusa": "Medusa heads in the checkpoint; a chain, or a tree (--speculative-tree-width or --speculative-tree-choices)",
    "lookahead": "Jacobi iteration feeds an n-gram pool (--speculative-lookahead-window, -ngram, -guesses)",
    "layerskip": "the model's own first E layers draft (--exit-layer; a checkpoint with early exits)",
    "eagle": "an EAGLE head in the checkpoint drafts from the target's hidden states; chain or tree",
    "mtp": "the checkpoint's own multi-token-prediction modules (DeepSeek-V3) draft from its hidden states; a chain",
}
METHODS = tuple(METHOD_HELP)
_LAZY = {"SpecStats": "baton.serve.speculative.config", "SpeculativeConfig": "baton.serve.speculative.config"}
__all__ = ["METHODS", "METHOD_HELP", *_LAZY]


def __getattr__(name: str):
    """SpeculativeConfig and SpecStats on first use: METHODS alone stays cheap (`baton --help`)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
