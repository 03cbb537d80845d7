"""GPTQ (Frantar et al., 2022): quantize a layer's weight column by column, compensating each
column's rounding error in the columns not yet quantized, with the inverse Hessian of the layer-wise
objective ||WX - QX||^2 (H = 2 X X^T over the calibration inputs).

Follows the reference implementation: dead inputs zeroed, diagonal damping, the upper Cholesky factor
of H^-1, lazy batch updates (the error of a block of columns is applied to the rest in one matmul).
With act_order, columns are processed in order of decreasing H_ii; int4 group parameters are then
fixed up front from the unquantized weights ("static groups"), so groups stay contiguous input
channels and the kernels' format needs no g_idx.
"""

from __future__ import annotations

import torch
from baton.common.model import DecoderLayer
from baton.serve.quantization.calibration import LayerRunner, on_inputs
from baton.serve.quantization.config import QuantConfig
from baton.serve.quantization.linear import quantizable_linears, set_module
from baton.serve.quantization.rtn import (
    int4_module,
    int4_params,
    int4_round,
    int8_module,
    int8_round,
    int8_scales,
    pad_groups,
    rtn_linear,
)


class HessianAccumulator:
    """H = 2/n * sum of x x^T over every input row a linear layer sees."""

    def __init__(self, in_features: int, device: torch.device):
        self.xtx = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        self.xtx += x.T @ x
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        return (2 * self.xtx / max(self.count, 1)).float()


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int = 128,
    act_order: bool = False,
    damp_percent: float = 0.01,
    block_size: int = 128,
):
    """Quantize weight [N, K] against hessian [K, K].

    Returns (levels, scales, zeros): integer levels as float [N, K'] (K' = K padded to whole groups
    for int4), scales [N] (int8) or [N, K'/g] (int4), zeros [N, K'/g] (int4) or None.
    """
    W = weight.detach().float().clone()
    H = hessian.detach().float().clone()
    if bits == 4:
        W = pad_groups(W, group_size)
        H = torch.nn.functional.pad(H, (0, W.shape[1] - H.shape[1], 0, W.shape[1] - H.shape[1]))
        if block_size % group_size:
            block_size = group_size * max(1, block_size // group_size)
    n, k = W.shape
    dead = torch.diag(H) == 0  # inputs that are always zero: their weights cannot matter
    H[dead, dead] = 1
    W[:, dead] = 0
    scales = zeros = None
    if bits == 8:
        scales = int8_scales(W)
    elif act_order:
        scales, zeros = int4_params(W, group_size)
    else:
        scales = torch.zeros(n, k // group_size, device=W.device)
        zeros = torch.zeros_like(scales)
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp_percent * torch.mean(torch.diag(H)) * torch.eye(k, device=W.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            w, col = W1[:, i], int(perm[i1 + i])
            if bits == 8:
                q = int8_round(w, scales)
                deq = q * scales
            else:
                g = col // group_size
                if not act_order and col % group_size == 0:  # group parameters from the updated weights
                    scales[:, g : g + 1], zeros[:, g : g + 1] = int4_params(W1[:, i : i + group_size], group_size)
                q = int4_round(w, scales[:, g], zeros[:, g])
                deq = (q - zeros[:, g]) * scales[:, g]
            Q[:, i1 + i] = q
            err = (w - deq) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q[:, torch.argsort(perm)], scales, zeros


def gptq_layer(runner: LayerRunner, layer: DecoderLayer, qcfg: QuantConfig) -> None:
    """Accumulate every linear's Hessian over the calibration set, then quantize each in place."""
    linears = quantizable_linears(layer)
    acc = {n: HessianAccumulator(m.in_features, m.weight.device) for n, m in linears.items()}
    with on_inputs(linears, lambda name, x: acc[name].add(x)):
        runner.run(layer)
    for name, lin in linears.items():
        if acc[name].count == 0:  # an expert the router never chose on this data: nothing to compensate
            set_module(layer, name, rtn_linear(lin, "int4" if qcfg.bits == 4 else "int8", qcfg.group_size))
            continue
        levels, scales, zeros = gptq_quantize(
            lin.weight,
            acc[name].hessian(),
            qcfg.bits,
            qcfg.group_size,
            qcfg.act_order,
            qcfg.damp_percent,
            qcfg.gptq_block_size,
        )
        mod = (
            int8_module(lin, levels, scales)
            if qcfg.bits == 8
            else int4_module(lin, levels, scales, zeros, qcfg.group_size)
        )
        set_module(layer, name, mod)
