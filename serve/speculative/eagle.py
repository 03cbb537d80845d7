"""EagleProposer: the EAGLE head (baton.common.eagle) drafts from the target's own features.

Per sequence the proposer keeps the head layer's K/V for the positions whose target feature it
has seen: from the prompt's last token on (the engine computes hidden states only for the rows
it samples), then every accepted token's, handed over after each verification (observe_path).
A proposal first runs the head over the features not yet in that cache (the last step's accepted
rows), whose last output is the predicted feature of the next position; drafting then feeds each
predicted feature back with its drafted token, one head pass per depth for the whole batch:

  * a chain (tree_width 1): k tokens, the head's argmax (greedy) or samples from its distribution
    under the request's sampling settings (their probabilities go to the verifier);
  * EAGLE-2's dynamic tree (tree_width > 1, tree.py's ScoredTree): each depth expands the
    `tree_width` best nodes by cumulative draft probability; each node's row attends to the cache
    and its ancestors' rows only; the best tree_nodes nodes are proposed.

The drafted rows' K/V are dropped after proposing: the cache only ever holds rows computed from
the target's features, so a rejected draft leaves nothing to roll back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from baton.common.model import fuse_residual_norms
from baton.kernels.linear_cpu import pack_linears
from baton.serve.core.sequence import Sequence
from baton.serve.runner.fusion import fuse_projections
from baton.serve.sampler import target_distribution
from baton.serve.speculative.base import Proposer
from baton.serve.speculative.config import SpeculativeConfig
from baton.serve.speculative.tree import ScoredTree


@dataclass
class _Cache:
    """The head layer's K/V [n, Hkv, D] for positions start..start+n-1, and the features seen but
    not yet run: (first position, [m, H])."""

    start: int = 0
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + (0 if self.k is None else self.k.shape[0])


class _Rows:
    """Attention for one head pass over B sequences' new rows: each row sees its sequence's
    context (cache, then earlier draft rows) where `mask` says, and records the new K/V."""

    def __init__(self, ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor):
        self.ctx_k, self.ctx_v = ctx_k, ctx_v  # [B, C, Hkv, D]
        self.mask = None if mask is None else mask[:, None]  # [B, N, C + N] (None: every row sees all)
        self.k = self.v = None

    def __call__(self, q, k, v, layer):
        self.k, self.v = k, v
        keys, vals = torch.cat([self.ctx_k, k], 1), torch.cat([self.ctx_v, v], 1)
        q, keys, vals = (t.transpose(1, 2) for t in (q, keys, vals))
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=self.mask, scale=layer.scaling, enable_gqa=True)
        return out.transpose(1, 2)


def _pad(rows: list[torch.Tensor], n: int) -> torch.Tensor:
    """Stack [n_i, ...] tensors into [B, n, ...], zero-padded."""
    out = rows[0].new_zeros(len(rows), n, *rows[0].shape[1:])
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


class EagleProposer(Proposer):
    wants_hidden = True

    def __init__(self, cfg: SpeculativeConfig, model_dir: str | Path, device, dtype):
        from baton.common.eagle import features, load_eagle

        self.cfg = cfg
        float_dtype = dtype if dtype is not None and dtype.is_floating_point else None
        # the head's layer runs as the target's do: fused q/k/v and gate/up, residual-add in the norm
        self.head = fuse_projections(fuse_residual_norms(load_eagle(model_dir, device, float_dtype)))
        p = next(self.head.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            pack_linears(self.head)
        self._features = lambda h: features(h.to(self.device, self.dtype), self.head.target[1])
        self.caches: dict[int, _Cache] = {}
        self.generators: dict[int, torch.Generator] = {}

    # ------------------------------------------------------------------------ target features
    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """A plain step: the state of the last token (position num_tokens - 1; not yet appended)."""
        self._seen(seq, seq.num_tokens - 1, hidden[None])

    def observe_path(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """A verification: the root's and each accepted proposal's state (all tokens appended)."""
        self._seen(seq, seq.num_tokens - 1 - hidden.shape[0], hidden)

    @torch.inference_mode()
    def _seen(self, seq: Sequence, first: int, hidden: torch.Tensor) -> None:
        self.caches.setdefault(seq.seq_id, _Cache()).pending.append((first, self._features(hidden)))

    def _catch_up(self, seq: Sequence) -> tuple[int, torch.Tensor] | None:
        """(first position, features [m, H]) to run now, the cache cut back to fit before them;
        None when the feature of the position before the last token is missing."""
        c = self.caches.get(seq.seq_id)
        if c is None or not c.pending:
            return None
        first, rows = c.pending[0]
        for pos, more in c.pending[1:]:
            if not first < pos <= first + rows.shape[0]:  # a gap (or a recompute): start afresh there
                first, rows = pos, more
            else:
                rows = torch.cat([rows[: pos - first], more])
        c.pending.clear()
        rows = rows[: seq.num_tokens - 1 - first]  # row t needs token t + 1
        if rows.shape[0] == 0 or first + rows.shape[0] != seq.num_tokens - 1:
            return None
        if not c.start <= first <= c.end:  # recomputed from before the cache, or after a gap
            c.start, c.k, c.v = first, None, None
        elif c.k is not None:
            c.k, c.v = c.k[: first - c.start], c.v[: first - c.start]
        return first, rows

    # ------------------------------------------------------------------------ one head pass
    def _pass(self, items: list[tuple]) -> torch.Tensor:
        """items: per sequence (context K, context V, visibility [n, C] of the context per new
        row or None (all of it), feats [n, H], next tokens [n], positions [n], causal among the new rows?). Returns
        the new rows' outputs [B, N, H]; self._new_kv holds their K/V [B, N, Hkv, D]."""
        if len(items) == 1 and items[0][2] is None and items[0][3].shape[0] == 1:
            # one row seeing its whole context (a chain at batch 1): no padding, no mask
            ck, cv, _, feats, toks, pos, _ = items[0]
            attn = _Rows(ck[None], cv[None], None)
            out = self.head(feats[None], toks[None], pos[None], attn)
            self._new_kv = (attn.k, attn.v)
            return out
        n = max(it[3].shape[0] for it in items)
        c = max(it[0].shape[0] for it in items)
        mask = torch.zeros(len(items), n, c + n, dtype=torch.bool)
        for b, (ck, _, vis, feats, _, _, causal) in enumerate(items):
            m, cl = feats.shape[0], ck.shape[0]
            mask[b, :m, :cl] = True if vis is None else vis
            own = torch.ones(m, m, dtype=torch.bool).tril() if causal else torch.eye(m, dtype=torch.bool)
            mask[b, :m, c : c + m] = own
            mask[b, m:, c + m :] |= torch.eye(n - m, dtype=torch.bool)  # padding sees itself
        attn = _Rows(_pad([it[0] for it in items], c), _pad([it[1] for it in items], c), mask.to(self.device))
        out = self.head(
            _pad([it[3] for it in items], n),
            _pad([it[4] for it in items], n),
            _pad([it[5] for it in items], n),
            attn,
        )
        self._new_kv = (attn.k, attn.v)
        return out

    # ------------------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        live: list[tuple[Sequence, _Cache, int]] = []
        items = []
        empty = torch.zeros(0, self.head.layer.self_attn.num_kv_heads, self.head.layer.self_attn.head_dim)
        empty = empty.to(self.device, self.dtype)
        for s in seqs:
            got = self._catch_up(s)
            if got is None:
                continue
            first, feats = got
            c = self.caches[s.seq_id]
            ck, cv = (c.k, c.v) if c.k is not None else (empty, empty)
            m = feats.shape[0]
            toks = torch.tensor(s.token_ids[first + 1 : first + 1 + m], device=self.device)
            pos = torch.arange(first, first + m, device=self.device)
            items.append((ck, cv, None, feats, toks, pos, True))
            live.append((s, c, m))
        if not live:
            return
        out = self._pass(items)
        nk, nv = self._new_kv
        roots = []
        for b, (s, c, m) in enumerate(live):  # the target-feature rows join the cache for good
            c.k = nk[b, :m] if c.k is None else torch.cat([c.k, nk[b, :m]])
            c.v = nv[b, :m] if c.v is None else torch.cat([c.v, nv[b, :m]])
            roots.append(out[b, m - 1])
        if self.cfg.tree_width > 1:
            self._trees(live, roots, ks)
        else:
            self._chains(live, roots, ks)

    def _sample(self, s: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The drafted token and (sampling only) the distribution it was drawn from."""
        if s.params.greedy:  # (the verifier needs no draft probabilities for a greedy request)
            return int(torch.argmax(logits)), None
        if s.params.seed is not None and s.seq_id not in self.generators:
            # a stream apart from the target's (seed + index), as the draft model's
            seed = (s.params.seed * 7919 + s.index + 1) % 2**64
            self.generators[s.seq_id] = torch.Generator().manual_seed(seed)
        q = target_distribution(logits.float().cpu(), s)
        return int(torch.multinomial(q, 1, generator=self.generators.get(s.seq_id))), q

    def _chains(self, live, roots: list[torch.Tensor], ks: dict[int, int]) -> None:
        """k head passes, each over one row per sequence that still drafts. Greedy batches keep the
        drafted tokens as tensors (the argmax of the batch's logits, fed straight to the next pass)
        and convert once at the end; every row sees its whole context, so no masks are built."""
        greedy = all(s.params.greedy for s, _, _ in live)
        logits = self.head.logits(torch.stack(roots))
        ctx = [(c.k, c.v) for _, c, _ in live]  # per sequence: the cache, then its drafted rows
        last = roots
        if greedy:
            drafted = [logits.argmax(-1)]  # [B] per depth
        else:
            first = [self._sample(s, logits[b]) for b, (s, _, _) in enumerate(live)]
            toks, probs = [[t] for t, _ in first], [[q] for _, q in first]
        depth_k = max(ks[s.seq_id] for s, _, _ in live)
        for depth in range(1, depth_k):
            step = [b for b, (s, _, _) in enumerate(live) if depth < ks[s.seq_id]]
            if not step:
                break
            items = []
            for i, b in enumerate(step):
                s = live[b][0]
                pos = torch.full((1,), s.num_tokens - 2 + depth, device=self.device)
                tok = drafted[-1][b : b + 1] if greedy else torch.tensor(toks[b][-1:], device=self.device)
                items.append((*ctx[b], None, last[b][None], tok, pos, True))
            out = self._pass(items)
            nk, nv = self._new_kv
            logits = self.head.logits(out[:, 0])
            if greedy:
                nxt = logits.argmax(-1)
                if len(step) < len(live):  # the sequences done drafting keep their last token
                    nxt = drafted[-1].index_copy(0, torch.tensor(step, device=self.device), nxt)
                drafted.append(nxt)
            last = list(last)
            for i, b in enumerate(step):
                ctx[b] = (torch.cat([ctx[b][0], nk[i, :1]]), torch.cat([ctx[b][1], nv[i, :1]]))
                last[b] = out[i, 0]
                if not greedy:
                    tok, q = self._sample(live[b][0], logits[i])
                    toks[b].append(tok)
                    probs[b].append(q)
        if greedy:
            toks = torch.stack(drafted, 1).tolist()  # [B, depth]: the one host conversion
        for b, (s, _, _) in enumerate(live):
            s.spec_token_ids = toks[b][: ks[s.seq_id]]
            # (a greedy request in a mixed batch drafts by argmax: no draft probabilities to stack)
            s.spec_draft_probs = None if greedy or s.params.greedy else torch.stack(probs[b][: ks[s.seq_id]])

    def _trees(self, live, roots: list[torch.Tensor], ks: dict[int, int]) -> None:
        """EAGLE-2: expand the `tree_width` best nodes of each depth by cumulative draft probability."""
        probs = torch.softmax(self.head.logits(torch.stack(roots)).float(), -1).cpu()
        trees, frontier, outs, rows = [], [], [], []  # rows: node -> index of its K/V among the draft rows
        dks, dvs = [], []
        for b in range(len(live)):
            t = ScoredTree(self.cfg.tree_width)
            frontier.append(t.expand(-1, probs[b]))
            trees.append(t)
            outs.append({-1: roots[b]})
            rows.append({})
            dks.append([])
            dvs.append([])
        for depth in range(1, max(ks[s.seq_id] for s, _, _ in live)):
            step, items = [], []
            for b, (s, c, _) in enumerate(live):
                t = trees[b]
                nodes = t.frontier(frontier[b]) if depth < ks[s.seq_id] else []
                if not nodes:
                    continue
                ck, cv = torch.cat([c.k, *dks[b]]), torch.cat([c.v, *dvs[b]])
                vis = torch.zeros(len(nodes), ck.shape[0], dtype=torch.bool)
                vis[:, : c.k.shape[0]] = True
                for r, i in enumerate(nodes):
                    a = t.parents[i]
                    while a >= 0:
                        vis[r, c.k.shape[0] + rows[b][a]] = True
                        a = t.parents[a]
                feats = torch.stack([outs[b][t.parents[i]] for i in nodes])
                toks = torch.tensor([t.tokens[i] for i in nodes], device=self.device)
                pos = torch.tensor([s.num_tokens - 1 + t.depths[i] - 1 for i in nodes], device=self.device)
                items.append((ck, cv, vis, feats, toks, pos, False))
                step.append((b, nodes))
            if not step:
                break
            out = self._pass(items)
            nk, nv = self._new_kv
            p = torch.softmax(self.head.logits(out).float(), -1).cpu()
            for i, (b, nodes) in enumerate(step):
                t, new = trees[b], []
                for r, node in enumerate(nodes):
                    rows[b][node] = len(dks[b]) + r
                    outs[b][node] = out[i, r]
                    new += t.expand(node, p[i, r])
                dks[b].append(nk[i, : len(nodes)])
                dvs[b].append(nv[i, : len(nodes)])
                frontier[b] = new
        for b, (s, _, _) in enumerate(live):
            s.spec_token_ids, s.spec_parents = trees[b].select(self.cfg.node_budget)

    def release(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)
        self.generators.pop(seq.seq_id, None)
