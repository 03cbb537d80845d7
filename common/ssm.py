"""The Mamba2 mixer: the recurrent layer of Baton's hybrid family (Bamba).

Why Bamba (Mamba2 + Llama attention) rather than Qwen3-Next's Gated DeltaNet: its attention
layers are Llama's (Baton's Attention with half of each head rotated, SwiGLU MLPs, RMSNorms), so
the only new piece is this mixer; its scan (SSD) is a chunked matmul form with a scalar decay per
head, which the Triton kernel (kernels/ssd_scan.py) runs with plain tl.dot tiles; transformers'
BambaForCausalLM has a pure-torch path on CPU, so parity needs neither mamba_ssm nor
causal_conv1d; and real checkpoints (ibm-ai-platform/Bamba-9B) exist. Gated DeltaNet's delta-rule
state update and Qwen3-Next's gated attention, MoE and shared experts would each be new.

Data path (HF BambaMixer's, parameter names equal): in_proj -> (gate z, xBC, dt); causal
depthwise conv1d + silu over xBC -> (x, B, C); dt = softplus(dt + dt_bias) clamped to
time_step_limit; the selective scan with A = -exp(A_log) plus the skip D x; RMSNorm of
y * silu(z) per group; out_proj. `mix` takes and returns the recurrent state (the conv window
and the SSM state), so a server can carry it across prefill chunks and decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from baton.common.config import ModelConfig
from baton.kernels.ssd_scan import ssd_scan
from torch import nn


@dataclass
class MambaState:
    """One mixer's recurrent state for a batch: the last d_conv - 1 conv inputs [b, conv_dim,
    d_conv - 1] and the SSM state [b, heads, head_dim, d_state] (float32)."""

    conv: torch.Tensor
    ssm: torch.Tensor


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over x [b, c, l] with weight [c, k], after `window` (the previous
    k - 1 inputs, zeros when None); returns (silu(conv), the new window)."""
    k = weight.shape[-1]
    if window is None:
        window = x.new_zeros(x.shape[0], x.shape[1], k - 1)
    xp = torch.cat([window.to(x.dtype), x], dim=-1)
    if x.shape[-1] == 1:  # a decode step: one dot per channel (the conv call costs far more)
        out = (xp * weight).sum(-1, keepdim=True)
        out = out if bias is None else out + bias[:, None]
    else:
        out = F.conv1d(xp, weight[:, None, :], bias, groups=x.shape[1])
    return F.silu(out), xp[..., xp.shape[-1] - (k - 1) :]


def scan_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence, for decode: h = exp(dt A) h + dt x B^T, y = h C - a handful of
    elementwise ops instead of the chunked scan's one-token chunk. x [b, heads, p], dt [b, heads],
    B and C [b, groups, n], state [b, heads, p, n]; returns (y [b, heads, p], new state), float32."""
    rep = x.shape[1] // B.shape[1]
    B, C = (t.float().repeat_interleave(rep, dim=1) for t in (B, C))
    decay = torch.exp(dt * A)[..., None, None]
    h = state.float() * decay + (dt[..., None] * x.float())[..., None] * B[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", h, C), h


class GatedRMSNorm(nn.Module):
    """RMSNorm of x * silu(z) over groups of channels, in float32 (HF's BambaRMSNormGated)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(x.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.mamba_n_heads, cfg.mamba_d_head
        self.n_groups, self.d_state = cfg.mamba_n_groups, cfg.mamba_d_state
        self.inner = cfg.mamba_expand * h
        self.chunk_size = cfg.mamba_chunk_size
        self.time_step_limit = tuple(cfg.time_step_limit)
        self.conv_dim = self.inner + 2 * self.n_groups * self.d_state
        self.in_proj = nn.Linear(h, self.inner + self.conv_dim + self.num_heads, bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            cfg.mamba_d_conv,
            groups=self.conv_dim,
            padding=cfg.mamba_d_conv - 1,
            bias=cfg.mamba_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.n_groups, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.inner, h, bias=cfg.mamba_proj_bias)

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """Mamba2's init of the SSM parameters (A = -1..-heads, D = 1, dt_bias = 1), as HF's."""
        self.A_log.copy_(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        self.dt_bias.fill_(1.0)
        self.norm.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, l, hidden] from a zero state (a whole sequence)."""
        return self.mix(x)[0]

    def mix(self, x: torch.Tensor, state: MambaState | None = None) -> tuple[torch.Tensor, MambaState]:
        """x [b, l, hidden] continuing from `state` (None: the start of the sequences); returns
        the output and the state after the last token."""
        b, length, _ = x.shape
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        xbc, window = causal_conv1d(
            xbc.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias, None if state is None else state.conv
        )
        xs, B, C = xbc.transpose(1, 2).split(
            [self.inner, self.n_groups * self.d_state, self.n_groups * self.d_state], dim=-1
        )
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)
        xs = xs.reshape(b, length, self.num_heads, self.head_dim)
        A = -torch.exp(self.A_log.float())
        B, C = (t.reshape(b, length, self.n_groups, self.d_state) for t in (B, C))
        if length == 1 and state is not None and not torch.is_grad_enabled():  # a decode step
            y, ssm = scan_step(xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state.ssm)
            y = y[:, None]
        else:
            y, ssm = ssd_scan(xs, dt, A, B, C, self.chunk_size, None if state is None else state.ssm)
        y = y + self.D.float()[:, None] * xs.float()
        y = self.norm(y.reshape(b, length, self.inner), z)
        return self.out_proj(y.to(x.dtype)), MambaState(conv=window, ssm=ssm)
