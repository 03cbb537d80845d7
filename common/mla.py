"""Multi-head latent attention (DeepSeek-V2/V3, arXiv 2405.04434), HF DeepseekV3Attention's names.

Each token's keys and values are one compressed latent (kv_lora_rank wide, after kv_a_layernorm)
plus one rope key shared by all heads (qk_rope_head_dim): that pair is all a cache needs to hold.
kv_b_proj decompresses the latent into per-head no-rope keys (W_UK) and values (W_UV). Two ways to
attend, with equal results:

- naive: decompress, then ordinary attention with q = [q_nope, q_pe] and k = [k_nope, k_pe] per
  head and values v_head_dim wide. What training (DenseCausalAttention) and any backend without a
  latent cache run, through the usual `attn(q, k, v, layer)`.
- absorbed: fold W_UK into the query (q_lat = q_nope @ W_UK, kv_lora_rank wide) and attend over the
  latents themselves, then apply W_UV to the output. A backend with a latent cache answers through
  `attn.mla(q_nope, q_pe, latent, k_pe, layer)`; `absorbed_reference` is its definition in torch.

The softmax scale is (qk_nope + qk_rope) ** -0.5, times YaRN's mscale_all_dim factor squared
(rope.mla_softmax_mscale); YaRN's attention_factor multiplies the rotated q_pe and k_pe (HF applies
it to cos/sin), so a cached k_pe is the rotated, scaled key as HF caches it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from baton.common.config import ModelConfig
from baton.common.rope import attention_factor, mla_softmax_mscale
from baton.kernels import apply_rotary
from torch import nn

# HF's DeepseekV3Attention builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not
# rms_norm_eps (DeepSeek's own code does the same; its checkpoints use 1e-6 for both anyway).
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """DecoderLayer.self_attn of a deepseek_v3 model. `norm` builds an RMSNorm (model.RMSNorm: this
    module sits below common/model.py, which builds it)."""

    # What attention backends read off a layer (common/model.py's Attention has them too).
    sliding_window = None
    logit_softcap = None
    sinks = None

    def __init__(self, cfg: ModelConfig, layer_idx: int, norm: Callable[[int, float], nn.Module]):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = self.num_kv_heads = cfg.num_attention_heads  # (the naive form's K/V heads)
        self.kv_lora_rank, self.q_lora_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim  # the naive form's q/k width
        self.rotary_dim = self.qk_rope_head_dim
        self.rope_interleave = bool(cfg.rope_interleave)
        self.scaling = self.head_dim**-0.5 * mla_softmax_mscale(cfg.rope_scaling)
        self.rope_factor = attention_factor(cfg.rope_scaling)
        h, heads, bias = cfg.hidden_size, self.num_heads, cfg.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * self.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = norm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = norm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_head_dim, h, bias=bias)

    # ------------------------------------------------------------------------------ the pieces
    def w_uk(self) -> torch.Tensor:
        """[H, qk_nope_head_dim, kv_lora_rank]: each head's no-rope key from the latent (a view)."""
        return self._w_ukv()[:, : self.qk_nope_head_dim]

    def w_uv(self) -> torch.Tensor:
        """[H, v_head_dim, kv_lora_rank]: each head's value from the latent (a view)."""
        return self._w_ukv()[:, self.qk_nope_head_dim :]

    def _w_ukv(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, hidden] -> q_nope [B, S, H, nope], q_pe [B, S, H, rope] (rotated), latent
        [B, S, kv_lora_rank] (normed) and k_pe [B, S, rope] (rotated): what attention and a cache need."""
        b, s, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(b, s, self.num_heads, self.head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rotate(q_pe, k_pe, cos, sin)
        return q_nope, q_pe, self.kv_a_layernorm(latent), k_pe

    def rotate(
        self, q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q_pe [B, S, H, R] and k_pe [B, S, R] with cos/sin [B, S, R] (cat(freqs, freqs)).
        Interleaved (DeepSeek's layout, HF apply_rotary_pos_emb_interleave): the pairs (x0, x1),
        (x2, x3)... turn by one frequency each and come out as cat(evens', odds'), which is rotate_half
        applied to cat(evens, odds)."""
        b, s, h, r = q_pe.shape
        if self.rope_interleave:
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
        t = b * s
        q_pe, k_pe = apply_rotary(
            q_pe.reshape(t, h, r).contiguous(), k_pe.reshape(t, 1, r).contiguous(), cos.reshape(t, r), sin.reshape(t, r)
        )
        if self.rope_factor != 1.0:
            q_pe, k_pe = q_pe * self.rope_factor, k_pe * self.rope_factor
        return q_pe.view(b, s, h, r), k_pe.view(b, s, r)

    def decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [..., kv_lora_rank] -> per-head k_nope [..., H, nope] and v [..., H, v_head_dim]."""
        kv = self.kv_b_proj(latent).view(*latent.shape[:-1], self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        return kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [..., H, nope] -> q_lat [..., H, kv_lora_rank] = q_nope[h] @ w_uk[h]."""
        return torch.einsum("...hn,hnl->...hl", q_nope, self.w_uk())

    def expand_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [..., H, kv_lora_rank] (attention over latents) -> [..., H, v_head_dim] = o_lat[h] @ w_uv[h].T."""
        return torch.einsum("...hl,hvl->...hv", o_lat, self.w_uv())

    # ------------------------------------------------------------------------------ attention
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        """x [B, S, hidden] -> [B, S', hidden] (S' = S, or the backend's len(query_rows))."""
        b, s, _ = x.shape
        q_nope, q_pe, latent, k_pe = self.project(x, cos, sin)
        latent_attention = getattr(attn, "mla", None)
        if latent_attention is not None:
            out = latent_attention(q_nope, q_pe, latent, k_pe, self)
        else:
            k_nope, v = self.decompress(latent)
            q = torch.cat([q_nope, q_pe], dim=-1)
            k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(b, s, self.num_heads, self.qk_rope_head_dim)], dim=-1)
            out = attn(q, k, v, self)
        return self.o_proj(out.reshape(b, -1, self.num_heads * self.v_head_dim))

    def absorbed_reference(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The absorbed form in plain torch (fp32 math): what `attn.mla` must return.

        q_nope [B, S, H, nope], q_pe [B, S, H, R] for S queries; latent [B, T, L], k_pe [B, T, R] for
        T keys; mask [S, T] or [B, S, T] bool (True: visible), None: causal with the queries the
        last S of the T positions. score(t, s) = scaling * (q_lat[t] . latent[s] + q_pe[t] . k_pe[s]),
        o_lat = softmax(score) @ latent, out = o_lat @ w_uv.T -> [B, S, H, v_head_dim]."""
        s, t = q_nope.shape[1], latent.shape[1]
        if mask is None:
            mask = torch.ones(s, t, dtype=torch.bool, device=latent.device).tril(t - s)
        f = torch.float32
        q_lat = torch.einsum("bshn,hnl->bshl", q_nope.to(f), self.w_uk().to(f))
        scores = torch.einsum("bshl,btl->bhst", q_lat, latent.to(f))
        scores = (scores + torch.einsum("bshr,btr->bhst", q_pe.to(f), k_pe.to(f))) * self.scaling
        mask = mask if mask.dim() == 2 else mask[:, None]
        p = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
        o_lat = torch.einsum("bhst,btl->bshl", p, latent.to(f))
        return torch.einsum("bshl,hvl->bshv", o_lat, self.w_uv().to(f)).to(q_nope.dtype)
