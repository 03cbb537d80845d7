"""Rotary position embeddings (RoPE), with linear, Llama-3 and YaRN frequency scaling.

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
    elif rope_type == "yarn":
        inv_freq = _yarn_scale(head_dim, rope_theta, rs)
    return inv_freq


def _yarn_scale(dim: int, base: float, rs: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies by `factor`, extrapolate the high
    ones, with a linear ramp between the beta_fast and beta_slow rotation counts (HF's formula)."""
    factor, old_ctx = rs["factor"], rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no singular ramp)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def attention_factor(rope_scaling: dict | None) -> float:
    """YaRN's scale on cos and sin (1 for every other rope). Both q and k are rotated, so the model
    folds its square into the softmax scale instead: the same scores, and the cache keeps plain keys."""
    rs = rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = rs["factor"]
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
    return mscale(factor)


def mla_softmax_mscale(rope_scaling: dict | None) -> float:
    """DeepSeek's factor on MLA's softmax scale, mscale(factor, mscale_all_dim) ** 2 (HF's
    yarn_apply_mscale): YaRN's attention_factor reaches only the rope channels through cos and sin,
    and this brings the no-rope ones along. 1 without a scaled rope or mscale_all_dim."""
    rs = rope_scaling or {}
    m = rs.get("mscale_all_dim")
    if rs.get("rope_type", rs.get("type", "default")) == "default" or not m or rs["factor"] <= 1:
        return 1.0
    return (0.1 * m * math.log(rs["factor"]) + 1.0) ** 2


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
    """cos, sin of shape positions.shape + [head_dim], computed in float32 then cast. A model with a
    second rope for its sliding layers (Gemma 3) passes inv_freq [2, head_dim // 2]: then
    positions.shape + [2, head_dim], and each attention layer takes its row (Attention.rope_index)."""
    lead = positions.float().reshape(*positions.shape, *([1] * inv_freq.dim()))
    freqs = lead * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
