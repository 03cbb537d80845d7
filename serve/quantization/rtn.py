"""Round-to-nearest: the baseline quantizer and the grids every other method rounds onto.

The formats are the kernels' (baton.kernels.quant): int8 symmetric per output channel; int4
asymmetric min/max per group of `group_size` input channels; fp8 e4m3 per output channel.
GPTQ and AWQ choose *what* to round (compensated or rescaled weights); rounding itself is here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from baton.kernels.quant import (
    pack_int4,
    quantize_fp8_per_channel,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
    round_half_away,
)
from baton.serve.quantization.linear import QuantLinear, quantized_like
from torch import nn


def pad_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Zero-pad the input dimension to whole groups (zero columns meet zero-padded activations)."""
    return F.pad(w, (0, -w.shape[1] % group_size))


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    return quantize_int8_per_channel(w)[1]


def int4_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) [N, K / group_size] of the kernels' min/max int4 grid; K a multiple of group_size."""
    _, scales, zeros = quantize_int4_groupwise(w, group_size)
    return scales, zeros


def int8_round(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Integer levels in [-127, 127] (as float) of w [N, ...] with per-row scales [N]."""
    shape = (-1,) + (1,) * (w.dim() - 1)
    return round_half_away(w.float() / scales.view(shape)).clamp(-127, 127)


def int4_round(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Integer levels in [0, 15] (as float) of w [N, ...] with scales/zeros broadcastable to it."""
    return (round_half_away(w.float() / scales) + zeros).clamp(0, 15)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """RTN quantize-dequantize of w [N, K] in fp32 (what a search compares candidates with)."""
    if bits == 8:
        s = int8_scales(w)
        return int8_round(w, s) * s[:, None]
    n, k = w.shape
    g = pad_groups(w.float(), group_size).reshape(n, -1, group_size)
    scales, zeros = int4_params(g.reshape(n, -1), group_size)
    return ((int4_round(g, scales[..., None], zeros[..., None]) - zeros[..., None]) * scales[..., None]).reshape(n, -1)[
        :, :k
    ]


def int4_module(
    linear: nn.Linear, levels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> QuantLinear:
    """An Int4WeightLinear from integer levels [N, padded K] and per-group scales/zeros."""
    return quantized_like(
        linear,
        "int4",
        group_size,
        qweight=pack_int4(levels.to(torch.uint8)),
        scales=scales.float(),
        qzeros=zeros.float(),
    )


def int8_module(linear: nn.Linear, levels: torch.Tensor, scales: torch.Tensor) -> QuantLinear:
    return quantized_like(linear, "int8", qweight=levels.to(torch.int8), scales=scales.float())


@torch.no_grad()
def rtn_linear(linear: nn.Linear, fmt: str, group_size: int = 128) -> QuantLinear:
    """Quantize one linear layer by rounding to nearest in `fmt` (int8, int4, fp8 or w8a8)."""
    w = linear.weight.detach().float()
    if fmt in ("int8", "w8a8"):
        q, s = quantize_int8_per_channel(w)
        return quantized_like(linear, fmt, qweight=q, scales=s)
    if fmt == "fp8":
        q, s = quantize_fp8_per_channel(w)
        return quantized_like(linear, fmt, qweight=q, scales=s)
    packed, scales, zeros = quantize_int4_groupwise(pad_groups(w, group_size), group_size)
    return quantized_like(linear, "int4", group_size, qweight=packed, scales=scales, qzeros=zeros)
