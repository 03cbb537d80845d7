"""MTPProposer: DeepSeek-V3's multi-token-prediction modules (baton.common.mtp) draft for the very
model they were trained with (`--speculative mtp`, vLLM's method "mtp").

Module k (0-based) reads, at position i, the previous depth's hidden state there (k = 0: the
target's last hidden state after its final norm, what the engine hands a proposer that wants
hidden states) and the embedding of token i + k + 1, runs its one decoder block and predicts
token i + k + 2 through its shared head. Drafting from a sequence of T tokens (the target's state
known up to position T - 2, the one that produced token T - 1):

  * depth 0: module 0 at T - 2 with token T - 1 -> d_1 (token T);
  * depth d < n (n modules): module d at T - 2 with d_d, fed module d - 1's output (its
    shared_head.norm'd state, as vLLM and SGLang recycle it) -> d_{d+1};
  * deeper: the last module again, recursively, one position further each depth (vLLM's rule with
    its one module): its own previous output and the last drafted token.

The block's attention needs the module's keys over earlier positions. Per sequence each module
keeps its own cache of the rows it ran on real tokens only: module 0 from the prompt's last token
on (the engine computes hidden states only for the rows it samples, as for EAGLE), module k for
the positions whose token i + k + 1 is known, fed by module k - 1's outputs there. Draft rows are
dropped after proposing, so a rejected draft leaves nothing to roll back.

The attention runs dense in torch over the module's cache (a few hundred rows at most per draft
pass, one new row per sequence). An MLA block (DeepSeek-V3) keeps the latent form: per token the
normalised latent and the rotated shared k_pe (kv_lora_rank + qk_rope_head_dim values, like the
engine's paged MLA cache), attended in the absorbed form (W_UK folded into the query, W_UV after);
the naive form would keep num_heads x (qk_head_dim + v_head_dim) per token (71x more for
DeepSeek-V3's shapes) and decompress them every pass. Other blocks keep their K/V.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from baton.common.checkpoint import read_config
from baton.common.config import ConfigError
from baton.common.mla import MLAttention
from baton.common.model import CausalLM
from baton.serve.core.sequence import Sequence
from baton.serve.sampler import target_distribution
from baton.serve.speculative.base import Proposer
from baton.serve.speculative.config import SpeculativeConfig

Parts = tuple[torch.Tensor, ...]  # a module's cached rows: (latent|k_pe,) for MLA, (k, v) otherwise


def missing_weights_message(num_nextn_predict_layers: int = 0) -> str:
    return (
        f"--speculative mtp needs MTP weights: this checkpoint has num_nextn_predict_layers={num_nextn_predict_layers}"
    )


def check_mtp(directory: Path) -> None:
    """Before a server binds its port: the checkpoint carries MTP modules (read_config already says
    0 where config.json promises some but no weight file holds them, as DeepSeek-V3 configs do)."""
    n = read_config(directory).num_nextn_predict_layers
    if n == 0:
        promised = json.loads((directory / "config.json").read_text()).get("num_nextn_predict_layers") or 0
        why = (
            f" (config.json says {promised}, but no weight file holds its model.layers.N.* tensors)" if promised else ""
        )
        raise ConfigError(missing_weights_message(0) + why)


@dataclass
class _Module:
    """One module's state for one sequence: cached rows for positions start..end-1, and inputs
    (first position, hidden [m, H]) it has not run yet."""

    start: int = 0
    parts: Parts | None = None
    feed: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + (0 if self.parts is None else self.parts[0].shape[0])

    def take(self, limit: int) -> tuple[int, torch.Tensor] | None:
        """The fed rows up to position `limit` (the last whose token is known), merged in order (a
        later feed replaces what it overlaps; a gap starts afresh), the cache cut back to end just
        before them; later rows stay fed. None when nothing can run."""
        if not self.feed:
            return None
        first, rows = self.feed[0]
        for pos, more in self.feed[1:]:
            if not first < pos <= first + rows.shape[0]:  # a gap (or a recompute): start afresh there
                first, rows = pos, more
            else:
                rows = torch.cat([rows[: pos - first], more])
        n = max(0, min(rows.shape[0], limit - first + 1))
        self.feed = [(first + n, rows[n:])] if n < rows.shape[0] else []
        if n == 0:
            return None
        if not self.start <= first <= self.end:  # recomputed from before the cache, or after a gap
            self.start, self.parts = first, None
        elif self.parts is not None:
            self.parts = tuple(t[: first - self.start] for t in self.parts)
        return first, rows[:n]

    def append(self, new: Parts) -> None:
        self.parts = new if self.parts is None else tuple(torch.cat([a, b]) for a, b in zip(self.parts, new))


class _Rows:
    """Attention for one module pass over B sequences' new rows: row j of sequence b sees its
    context (C_b cached rows, all of them) and the new rows 0..j; `new` keeps the new rows' parts."""

    def __init__(self, ctx: Parts, mask: torch.Tensor | None, absorbed: tuple[torch.Tensor, torch.Tensor] | None):
        self.ctx = ctx  # each [B, C, ...], zero-padded
        self.absorbed = absorbed  # an MLA block's (W_UK, W_UV)
        self.mask = None if mask is None else mask[:, None]  # [B, 1, N, C + N]; None: one row sees all
        self.new: Parts = ()

    def __call__(self, q, k, v, layer):
        """A K/V block: q [B, N, H, D], k and v [B, N, Hkv, D]."""
        self.new = (k, v)
        keys, vals = (torch.cat([c, n], 1).transpose(1, 2) for c, n in zip(self.ctx, self.new))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, vals, attn_mask=self.mask, scale=layer.scaling, enable_gqa=True
        )
        return out.transpose(1, 2)

    def mla(self, q_nope, q_pe, latent, k_pe, layer):
        """An MLA block, absorbed: q_nope [B, N, H, nope], q_pe [B, N, H, R], latent [B, N, L],
        k_pe [B, N, R] -> [B, N, H, v_head_dim]; the latent is both key (with k_pe) and value."""
        self.new = (torch.cat([latent, k_pe], -1),)
        kv = torch.cat([self.ctx[0], self.new[0]], 1)[:, None]  # [B, 1, C + N, L + R]: one shared head
        w_uk, w_uv = self.absorbed
        q = torch.cat([torch.einsum("bnhd,hdl->bhnl", q_nope, w_uk), q_pe.transpose(1, 2)], -1)  # [B, H, N, L + R]
        o = F.scaled_dot_product_attention(
            q, kv, kv[..., : latent.shape[-1]], attn_mask=self.mask, scale=layer.scaling, enable_gqa=True
        )
        return torch.einsum("bhnl,hvl->bnhv", o, w_uv)


def absorbed_weights(attn: MLAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, qk_nope, L], W_UV [H, v_head_dim, L]) as the block's kv_b_proj computes them: its
    output for the identity, exact (each entry is one weight times 1). On CPU the engine's runner has
    packed kv_b_proj by now (its plain weight is gone, so attn.w_uk() cannot answer); a quantized one
    gives its dequantized weight."""
    p = next(attn.parameters())
    eye = torch.eye(attn.kv_lora_rank, device=p.device, dtype=p.dtype)
    with torch.inference_mode():
        w = attn.kv_b_proj(eye).T.reshape(attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim, -1)
    return w[:, : attn.qk_nope_head_dim].clone(), w[:, attn.qk_nope_head_dim :].clone()


def _pad(rows: list[torch.Tensor], n: int) -> torch.Tensor:
    """Stack [n_i, ...] tensors into [B, n, ...], zero-padded."""
    out = rows[0].new_zeros(len(rows), n, *rows[0].shape[1:])
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


class MTPProposer(Proposer):
    wants_hidden = True

    def __init__(self, cfg: SpeculativeConfig, model: CausalLM | None):
        if model is None:
            raise ValueError(
                "--speculative mtp runs the MTP modules on the engine's own model, in this process: "
                "not with tensor/pipeline parallel serving yet (serve it with tp = pp = 1)"
            )
        mtp = getattr(model, "mtp", None)
        if not mtp:
            raise ValueError(missing_weights_message(model.config.num_nextn_predict_layers))
        self.cfg, self.model, self.layers = cfg, model, list(mtp)
        p = next(self.layers[0].parameters())
        self.device, self.dtype = p.device, p.dtype
        blocks = [x.block.self_attn for x in self.layers]
        self.absorbed = [absorbed_weights(a) if isinstance(a, MLAttention) else None for a in blocks]
        self.inv_freq = model.model.inv_freq.to(self.device)  # (float32: the target's rotary frequencies)
        self.states: dict[int, list[_Module]] = {}
        self.generators: dict[int, torch.Generator] = {}

    def _empty(self, m: int) -> Parts:
        """Module m's parts for a sequence with nothing cached."""
        a = self.layers[m].block.self_attn
        z = lambda *shape: torch.zeros(0, *shape, device=self.device, dtype=self.dtype)  # noqa: E731
        if isinstance(a, MLAttention):
            return (z(a.kv_lora_rank + a.qk_rope_head_dim),)
        return z(a.num_kv_heads, a.head_dim), z(a.num_kv_heads, a.head_dim)

    # ------------------------------------------------------------------------ target hidden states
    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """A plain step: the state of the last token (position num_tokens - 1; not yet appended)."""
        self._seen(seq, seq.num_tokens - 1, hidden[None])

    def observe_path(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """A verification: the root's and each accepted proposal's state (all tokens appended)."""
        self._seen(seq, seq.num_tokens - 1 - hidden.shape[0], hidden)

    def _seen(self, seq: Sequence, first: int, hidden: torch.Tensor) -> None:
        state = self.states.setdefault(seq.seq_id, [_Module() for _ in self.layers])
        state[0].feed.append((first, hidden.to(self.device, self.dtype)))

    # ------------------------------------------------------------------------ one module pass
    def _pass(self, m: int, items: list[tuple[Parts, torch.Tensor, torch.Tensor, torch.Tensor]]):
        """Module m over B sequences' new rows. items: per sequence (cached parts, hidden [n, H],
        next tokens [n], positions [n]). Returns the outputs [B, N, H] (before shared_head.norm)
        and the new rows' parts, each [B, N, ...]."""
        n = max(it[1].shape[0] for it in items)
        c = max(it[0][0].shape[0] for it in items)
        mask = None
        if len(items) > 1 or n > 1:
            mask = torch.zeros(len(items), n, c + n, dtype=torch.bool)
            for b, (ctx, h, _, _) in enumerate(items):
                rows, cached = h.shape[0], ctx[0].shape[0]
                mask[b, :rows, :cached] = True
                mask[b, :rows, c : c + rows] = torch.ones(rows, rows, dtype=torch.bool).tril()
                mask[b, rows:, c + rows :] |= torch.eye(n - rows, dtype=torch.bool)  # padding sees itself
            mask = mask.to(self.device)
        ctx = tuple(_pad([it[0][i] for it in items], c) for i in range(len(items[0][0])))
        attn = _Rows(ctx, mask, self.absorbed[m])
        layer = self.layers[m]
        out = layer(
            _pad([it[1] for it in items], n),
            _pad([it[2] for it in items], n),
            _pad([it[3] for it in items], n),
            attn,
            self.model.model.embed,  # (the module's own copy of the embedding, where it has one, wins)
            self.inv_freq,
        )
        return out, attn.new

    def _catch_up(self, seqs: list[Sequence]) -> list[tuple[Sequence, torch.Tensor]]:
        """Each module over the real rows it can run now, module by module (module k's inputs are
        module k - 1's outputs); returns the sequences whose module-0 rows reached position
        num_tokens - 2, with that row's output (the root of the draft)."""
        roots = []
        for m, layer in enumerate(self.layers):
            items, owners = [], []
            for s in seqs:
                state = self.states.get(s.seq_id)
                got = None if state is None else state[m].take(s.num_tokens - 2 - m)
                if got is None:
                    continue
                first, h = got
                rows = h.shape[0]
                toks = torch.tensor(s.token_ids[first + m + 1 : first + m + 1 + rows], device=self.device)
                pos = torch.arange(first, first + rows, device=self.device)
                items.append((state[m].parts or self._empty(m), h, toks, pos))
                owners.append((s, state, first, rows))
            if not items:
                continue
            out, new = self._pass(m, items)
            normed = layer.norm_output(out) if m + 1 < len(self.layers) else None
            for b, (s, state, first, rows) in enumerate(owners):
                state[m].append(tuple(t[b, :rows] for t in new))
                if normed is not None:
                    state[m + 1].feed.append((first, normed[b, :rows]))
                if m == 0 and first + rows == s.num_tokens - 1:
                    roots.append((s, out[b, rows - 1]))
        return roots

    # ------------------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: dict[int, int]) -> None:
        live = self._catch_up(seqs)
        if not live:
            return
        n = len(self.layers)
        greedy = all(s.params.greedy for s, _ in live)  # greedy batches keep the drafts as tensors
        last = torch.stack([h for _, h in live])  # [B, H]: each sequence's previous depth's output
        logits = self.layers[0].logits(last, self.model.lm_head)
        if greedy:
            drafted = [logits.argmax(-1)]  # [B] per depth: one host conversion at the end
        else:
            first = [self._sample(s, logits[b]) for b, (s, _) in enumerate(live)]
            toks, probs = [[t] for t, _ in first], [[q] for _, q in first]
        recurring: list[Parts | None] = [None] * len(live)  # the last module's own draft rows
        for depth in range(1, max(ks[s.seq_id] for s, _ in live)):
            step = [b for b, (s, _) in enumerate(live) if depth < ks[s.seq_id]]
            if not step:
                break
            m = min(depth, n - 1)
            fed = self.layers[min(depth - 1, n - 1)].norm_output(last[step])
            items = []
            for i, b in enumerate(step):
                s = live[b][0]
                cached = self.states[s.seq_id][m].parts or self._empty(m)
                if recurring[b] is not None:
                    cached = tuple(torch.cat(p) for p in zip(cached, recurring[b]))
                pos = torch.full((1,), s.num_tokens - 2 + max(0, depth - (n - 1)), device=self.device)
                tok = drafted[-1][b : b + 1] if greedy else torch.tensor(toks[b][-1:], device=self.device)
                items.append((cached, fed[i : i + 1], tok, pos))
            out, new = self._pass(m, items)
            out = out[:, 0]
            if m == n - 1:  # it drafts on from here: its rows are the next depth's context
                for i, b in enumerate(step):
                    row = tuple(t[i, :1] for t in new)
                    recurring[b] = row if recurring[b] is None else tuple(map(torch.cat, zip(recurring[b], row)))
            logits = self.layers[m].logits(out, self.model.lm_head)
            index = torch.tensor(step, device=self.device)
            last = last.index_copy(0, index, out)
            if greedy:  # (the sequences done drafting keep their last token: cut off below)
                drafted.append(drafted[-1].index_copy(0, index, logits.argmax(-1)))
            else:
                for i, b in enumerate(step):
                    tok, q = self._sample(live[b][0], logits[i])
                    toks[b].append(tok)
                    probs[b].append(q)
        if greedy:
            toks = torch.stack(drafted, 1).tolist()
        for b, (s, _) in enumerate(live):
            s.spec_token_ids = toks[b][: ks[s.seq_id]]
            s.spec_draft_probs = None if s.params.greedy else torch.stack(probs[b][: ks[s.seq_id]])

    def _sample(self, s: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The drafted token and the distribution it was drawn from (the verifier's q), under the
        request's own sampling settings."""
        if s.params.greedy:
            return int(torch.argmax(logits)), None
        if s.params.seed is not None and s.seq_id not in self.generators:
            # a stream apart from the target's (seed + index), as the draft model's
            seed = (s.params.seed * 7919 + s.index + 1) % 2**64
            self.generators[s.seq_id] = torch.Generator().manual_seed(seed)
        q = target_distribution(logits.float().cpu(), s)
        return int(torch.multinomial(q, 1, generator=self.generators.get(s.seq_id))), q

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
        self.generators.pop(seq.seq_id, None)
