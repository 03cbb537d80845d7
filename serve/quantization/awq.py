"""AWQ (Lin et al., 2023): protect the weights that meet large activations by scaling their input
channels up before group-wise int4 rounding (and the activations down, folded into the previous op).

Per ScaleGroup the scale is s = x_mean^r / w_mean^(1-r), normalised, with the ratio r searched on a
grid to minimise the group's output error ||XW^T - (X/s) Q(W s)^T||^2 on calibration inputs, as in
AutoAWQ. s = 1 (plain round-to-nearest) is always a candidate, so the search never does worse than
it. Then a per-group clipping range is searched (AutoAWQ's auto_clip) for every linear except q/k.
"""

from __future__ import annotations

import torch
from baton.common.model import DecoderLayer
from baton.serve.quantization.calibration import LayerRunner, collect_inputs
from baton.serve.quantization.config import QuantConfig
from baton.serve.quantization.linear import set_module
from baton.serve.quantization.rtn import fake_quantize, pad_groups, rtn_linear
from baton.serve.quantization.scaling import fold_scales, layer_linears, scale_groups, stacked_weight

MAX_TOKENS = 4096  # calibration rows used by the searches (AutoAWQ uses a few thousand too)
# Query and key projections (MLA's too: kv_a_proj_with_mqa makes the latent keys and the rope key)
# are not clipped: their errors are amplified by the softmax.
QUERY_KEY = ("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")


def output_error(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, group_size: int) -> float:
    """Mean squared error of the scaled, int4-rounded product against the float one."""
    ref = x @ w.T
    return (((x / s) @ fake_quantize(w * s, 4, group_size).T - ref) ** 2).mean().item()


@torch.no_grad()
def search_scale(x: torch.Tensor, w: torch.Tensor, group_size: int, grid: int = 20) -> torch.Tensor:
    """Best per-input-channel scale [K] for inputs x [T, K] and stacked weights w [N, K]."""
    x, w = x.float(), w.float()
    x_mean = x.abs().mean(0)
    wg = pad_groups(w.abs(), group_size).reshape(w.shape[0], -1, group_size)
    w_mean = (wg / wg.amax(-1, keepdim=True).clamp(min=1e-8)).reshape(w.shape[0], -1)[:, : w.shape[1]].mean(0)
    best, best_err = torch.ones_like(x_mean), output_error(x, w, torch.ones_like(x_mean), group_size)
    for i in range(grid):
        r = i / grid
        s = (x_mean.pow(r) / w_mean.pow(1 - r).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = output_error(x, w, s, group_size)
        if err < best_err:
            best, best_err = s, err
    return best


@torch.no_grad()
def search_clip(
    x: torch.Tensor, w: torch.Tensor, group_size: int, grid: int = 20, max_shrink: float = 0.5
) -> torch.Tensor:
    """w [N, K] clamped per (row, group) to the range that minimises that group's output error."""
    n, k = w.shape
    xg = pad_groups(x.float(), group_size).reshape(x.shape[0], -1, group_size)  # [T, G, g]
    wg = pad_groups(w.float(), group_size).reshape(n, -1, group_size)  # [N, G, g]
    ref = torch.einsum("tgk,ngk->ngt", xg, wg)
    org_max = wg.abs().amax(-1, keepdim=True)
    best_max, best_err = org_max.clone(), torch.full(org_max.shape, float("inf"), device=w.device)
    for i in range(int(max_shrink * grid)):
        m = org_max * (1 - i / grid)
        q = fake_quantize(torch.clamp(wg, -m, m).reshape(n, -1), 4, group_size).reshape(wg.shape)
        err = ((torch.einsum("tgk,ngk->ngt", xg, q) - ref) ** 2).mean(-1, keepdim=True)
        better = err < best_err
        best_err, best_max = torch.where(better, err, best_err), torch.where(better, m, best_max)
    return torch.clamp(wg, -best_max, best_max).reshape(n, -1)[:, :k]


def awq_layer(runner: LayerRunner, layer: DecoderLayer, qcfg: QuantConfig) -> None:
    groups = scale_groups(layer)
    names = layer_linears(layer)  # o_proj has no group under GQA: it is quantized unscaled
    inputs = {n: x[:MAX_TOKENS] for n, x in collect_inputs(runner, layer, names).items()}
    for group in groups:
        first = next(iter(group.linears))
        s = search_scale(inputs[first], stacked_weight(group), qcfg.group_size, qcfg.awq_grid)
        fold_scales(group, s)
        for n in group.linears:  # these linears now read x / s
            inputs[n] = inputs[n] / s
    for name, lin in names.items():
        if qcfg.awq_clip and not name.endswith(QUERY_KEY):
            lin.weight.data.copy_(search_clip(inputs[name], lin.weight, qcfg.group_size))
        set_module(layer, name, rtn_linear(lin, "int4", qcfg.group_size))
