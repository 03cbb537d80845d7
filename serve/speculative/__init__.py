"""Speculative decoding: cheap proposals, one target pass to verify them, exact output.

  * proposers.py - the Proposer protocol and its methods, each setting seq.spec_token_ids (and
                   seq.spec_parents for a tree): NgramProposer (prompt lookup: copy what followed
                   the last occurrence of the current suffix), DraftProposer (a small model with its
                   own paged KV cache proposes k tokens, a chain or a SpecInfer-style tree of the
                   draft's top alternatives), MedusaProposer (Medusa heads on the target's last
                   hidden state propose a token tree)
  * decoder.py   - SpeculativeDecoder, what the engine calls: proposals before the schedule,
                   verification after the forward (`choose`), adaptive k and the stats
  * tree.py      - proposals as a token tree: building, packing (depths, attention mask), trimming
  * config.py    - SpeculativeConfig, SpecStats, AdaptiveK

Verification keeps the target's distribution exactly. At each node the candidates (children)
are tried in turn with rejection sampling: accept c with probability min(1, p(c)/q(c)), else
continue with the residual norm(max(p - q, 0)) (q is one-hot for deterministic proposals, which
makes this SpecInfer's multi-candidate rule); when no candidate is accepted the token is drawn
from the final residual. Greedy requests accept exactly the argmax. (Leviathan et al., 2023;
Chen et al., 2023; Miao et al., 2023.)
"""

from baton.serve.speculative.config import METHODS, SpecStats, SpeculativeConfig

__all__ = ["METHODS", "SpecStats", "SpeculativeConfig"]
