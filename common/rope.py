"""Rotary position embeddings (RoPE), with linear and Llama-3 frequency scaling.

cos/sin are computed from absolute positions on every forward rather than from a cached table,
so any position works (StreamingLLM and long-context serving run past max_position_embeddings).
The layout is HF/Llama's "rotate_half" (non-interleaved), which is what HF checkpoints expect;
applying the rotation is a kernel (baton.kernels.apply_rotary).
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, rope_theta: float = 10000.0, rope_scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 on the CPU, after rope_scaling
    (HF's rope_scaling dict: {"rope_type": "linear"|"llama3", "factor": ..., ...})."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rs = rope_scaling or {}
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rs)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rs: dict) -> torch.Tensor:
    """Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend in between."""
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape positions.shape + [head_dim], computed in float32 then cast."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
