"""Offline weight quantisation formats consumed by quant_matmul.py and w8a8.py.

All weights keep the nn.Linear layout [N (out), K (in)], scales are fp32:
  int8 per-channel  w ~ q[n, k] * scale[n],                    q int8 in [-127, 127]
  int4 group-wise   w ~ (q[n, k] - zero[n, g]) * scale[n, g],   q in [0, 15], g = k // group_size,
                    packed two per byte along K (low nibble = even k), zero is a float in [0, 15]
  fp8 e4m3          w ~ q[n, k] * scale[n],                    q float8_e4m3fn (|q| <= 448)
SmoothQuant (W8A8) first migrates activation outliers into the weights: x' = x / s, w' = w * s with
s = smoothquant_scales(...), then quantises w' per channel and x' per token at run time.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Rounding the quantisation kernels use too (floor(|x| + 0.5)), so both give the same integers."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scales fp32 [N]), symmetric, one scale per output channel."""
    scales = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = round_half_away(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K / 2] uint8 (even k in the low nibble)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def quantize_int4_groupwise(w: torch.Tensor, group_size: int = 128):
    """w [N, K] -> (packed uint8 [N, K/2], scales fp32 [N, K/g], zeros fp32 [N, K/g]), asymmetric min/max."""
    n, k = w.shape
    assert k % group_size == 0 and group_size % 2 == 0
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-8)
    zeros = round_half_away(-lo / scales).clamp(0, 15)
    q = (round_half_away(g / scales[..., None]) + zeros[..., None]).clamp(0, 15)
    return pack_int4(q.reshape(n, k)), scales, zeros


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], scales fp32 [N]) with the row max mapped to 448."""
    scales = w.float().abs().amax(dim=1).clamp(min=1e-8) / FP8_E4M3_MAX
    return (w.float() / scales[:, None]).to(torch.float8_e4m3fn), scales


def smoothquant_scales(act_absmax: torch.Tensor, w: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Per-input-channel s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha) (SmoothQuant, eq. 4)."""
    w_absmax = w.float().abs().amax(dim=0).clamp(min=1e-5)
    return (act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)).clamp(min=1e-5)
