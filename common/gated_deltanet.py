"""Gated DeltaNet (arXiv 2412.06464): the linear-attention mixer of Qwen3-Next and Qwen3.5.

Each value head keeps a state S [dk, dv] (float32). Per token, with q and k L2-normalised and q scaled
by dk ** -0.5, decay alpha = exp(g) and write strength beta:

    S <- alpha S                                  g = -exp(A_log) * softplus(a + dt_bias) <= 0
    S <- S + k (beta (v - S^T k))^T               the delta rule: write only what S does not already predict
    o  = S^T q

The rule itself is a kernel (kernels/gated_delta.py: a float64 reference, the token loop for decode,
the chunked WY/UT form for prefill and training - within a chunk the writes are solved for at once
with one triangular solve, and the state crosses each chunk boundary once - and Triton on CUDA).
With G_i the cumulative log decay inside a chunk starting from state S0, the writes
u_i = beta_i (v_i - alpha_i S_{i-1}^T k_i) solve the unit lower-triangular system

    u_i + beta_i sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(G_i) S0^T k_i

so u = U - W S0 with U, W from one solve per chunk; then o_i = exp(G_i) S0^T q_i + sum_{j<=i}
exp(G_i - G_j) (q_i . k_j) u_j and S_end = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T. Every
exponent is <= 0, so nothing overflows. A query/key head serves linear_num_value_heads /
linear_num_key_heads consecutive value heads (HF's grouping).

The mixer (`GatedDeltaNet`, HF Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet's parameter names):
in_proj -> q, k, v, the output gate z, b (beta = sigmoid(b)) and a; a causal depthwise conv + silu
over cat(q, k, v); the rule above; RMSNorm of each head's output times silu(z) (a plain weight, not
Qwen3.5's 1 + w); out_proj. Qwen3-Next packs its projections per key head (in_proj_qkvz, in_proj_ba),
Qwen3.5 keeps them apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); the math is the same.
`forward(x, state)` carries `GatedDeltaNetState` (conv window, recurrent state), so a server can run a
sequence in pieces and decode one token at a time at a cost flat in the context length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from baton.common.config import ModelConfig
from baton.common.ssm import causal_conv1d
from baton.kernels.gated_delta import gated_delta_rule, l2norm
from torch import nn

CHUNK_SIZE = 64  # (FLA's and HF's chunk)


class GatedDeltaNetState(NamedTuple):
    """One mixer's state for a batch: conv [B, conv_dim, K - 1], the last K - 1 inputs of the conv
    (q, k, v channels, the activations' dtype); recurrent [B, num_value_heads, dk, dv], float32."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class GatedDeltaNorm(nn.Module):
    """RMSNorm of each head's output, then times silu(z) (HF's Qwen3NextRMSNormGated, its order of
    casts: normed in float32, weighted in the activations' dtype, gated in float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """DecoderLayer.linear_attn of the Qwen3.5 / Qwen3-Next families (see the module docstring)."""

    chunk_size = CHUNK_SIZE

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        h = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = cfg.linear_conv_kernel_dim
        self.packed = cfg.model_type == "qwen3_next"  # Qwen3-Next's per-key-head packed projections
        if self.packed:
            self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        k = self.conv_kernel_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, k, groups=self.conv_dim, padding=k - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedDeltaNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """HF's init of the recurrence's parameters: dt_bias 1, A = exp(A_log) uniform in [0.01, 16]
        (away from 0, so A_log is finite), norm weight 1."""
        if self.A_log.is_meta:
            return
        a = torch.empty(self.num_v_heads).uniform_(0.01, 16, generator=generator)
        self.A_log.copy_(a.log())
        self.dt_bias.fill_(1.0)
        self.norm.weight.fill_(1.0)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, S, hidden] -> the conv's input cat(q, k, v) [B, S, conv_dim], z [B, S, Hv, dv], and
        b, a [B, S, Hv]."""
        bsz, s, _ = x.shape
        if not self.packed:
            z = self.in_proj_z(x).view(bsz, s, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next: per key head [q (dk), k (dk), v (r dv), z (r dv)] and [b (r), a (r)], r value heads each
        r, dk, dv = self.num_v_heads // self.num_k_heads, self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(bsz, s, self.num_k_heads, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(bsz, s, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([t.reshape(bsz, s, -1) for t in (q, k, v)], dim=-1)
        z = z.reshape(bsz, s, self.num_v_heads, dv)
        return mixed, z, b.reshape(bsz, s, -1), a.reshape(bsz, s, -1)

    def forward(
        self, x: torch.Tensor, state: GatedDeltaNetState | None = None
    ) -> tuple[torch.Tensor, GatedDeltaNetState]:
        """x [B, S, hidden] continuing from `state` (None: the sequences' start) -> (y [B, S, hidden],
        the state after the last token). The kernel picks the rule's form (the token loop for a
        decode, the chunked form for longer pieces and under autograd)."""
        bsz, s, _ = x.shape
        mixed, z, b, a = self.project(x)
        window = None if state is None else state.conv
        mixed, window = causal_conv1d(mixed.transpose(1, 2), self.conv1d.weight.squeeze(1), None, window)
        q, k, v = mixed.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(bsz, s, self.num_k_heads, self.head_k_dim).float())
        k = l2norm(k.reshape(bsz, s, self.num_k_heads, self.head_k_dim).float())
        v = v.reshape(bsz, s, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        initial = None if state is None else state.recurrent
        o, recurrent = gated_delta_rule(q, k, v, g, beta, initial, chunk_size=min(self.chunk_size, s))
        o = self.norm(o.to(x.dtype), z)
        return self.out_proj(o.reshape(bsz, s, self.value_dim)), GatedDeltaNetState(window, recurrent)

    def mix(self, x: torch.Tensor, state: GatedDeltaNetState | None = None):
        """forward under the name a state-carrying backend calls (common/hybrid_cache.py's `mix`)."""
        return self(x, state)

    def empty_state(self, batch: int, device=None, dtype: torch.dtype | None = None) -> GatedDeltaNetState:
        """The state at a sequence's start: zeros (what forward with state=None starts from)."""
        dtype = dtype or self.out_proj.weight.dtype
        conv = torch.zeros(batch, self.conv_dim, self.conv_kernel_size - 1, device=device, dtype=dtype)
        shape = (batch, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        return GatedDeltaNetState(conv, torch.zeros(shape, device=device, dtype=torch.float32))
