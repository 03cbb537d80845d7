"""SmoothQuant (Xiao et al., 2023) W8A8: migrate activation outliers into the weights with
s_j = max|X_j|^alpha / max|W_:,j|^(1-alpha), then int8 weights per channel and int8 activations
per token. alpha is fixed, or searched per ScaleGroup over a grid to minimise the group's W8A8
output error on calibration inputs (outlier severity differs between layers, so one alpha rarely
suits all)."""

from __future__ import annotations

import torch
from baton.common.model import DecoderLayer
from baton.kernels import quantize_per_token, smoothquant_scales
from baton.serve.quantization.calibration import LayerRunner, collect_inputs
from baton.serve.quantization.config import QuantConfig
from baton.serve.quantization.linear import set_module
from baton.serve.quantization.rtn import fake_quantize, rtn_linear
from baton.serve.quantization.scaling import fold_scales, layer_linears, scale_groups, stacked_weight

ALPHAS = tuple(i / 20 for i in range(2, 19))  # 0.10 .. 0.90
MAX_TOKENS = 4096


def w8a8_error(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> float:
    """Mean squared error of per-token int8 (x / s) times per-channel int8 (w * s) against x w^T."""
    q, qs = quantize_per_token(x / s)
    return (((q.float() * qs[:, None]) @ fake_quantize(w * s, 8, 0).T - x @ w.T) ** 2).mean().item()


@torch.no_grad()
def choose_scales(x: torch.Tensor, w: torch.Tensor, alpha: float | None) -> torch.Tensor:
    """Smoothing scales [K] for inputs x [T, K] and stacked weights w [N, K]."""
    act_max = x.abs().amax(0)
    if alpha is not None:
        return smoothquant_scales(act_max, w, alpha)
    return min((smoothquant_scales(act_max, w, a) for a in ALPHAS), key=lambda s: w8a8_error(x, w, s))


def smoothquant_layer(runner: LayerRunner, layer: DecoderLayer, qcfg: QuantConfig) -> None:
    groups = scale_groups(layer)
    names = layer_linears(layer)  # o_proj has no group under GQA: it is quantized unscaled
    inputs = collect_inputs(runner, layer, names)
    for group in groups:
        x = inputs[next(iter(group.linears))]
        fold_scales(
            group, choose_scales(x[:MAX_TOKENS] if qcfg.alpha is None else x, stacked_weight(group), qcfg.alpha)
        )
    for name, lin in names.items():
        set_module(layer, name, rtn_linear(lin, "w8a8"))
