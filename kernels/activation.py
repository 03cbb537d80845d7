"""SwiGLU activation of the Llama MLP: silu(gate) * up, one fused elementwise pass in fp32.

Fusing saves writing silu(gate) to memory and reading it back (the op is bandwidth-bound).
"""

from __future__ import annotations

import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import alloc, needs_grad, use_triton


@triton.jit
def _swiglu_kernel(Gate, Up, Out, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(Gate + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(Up + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + offs, (g * tl.sigmoid(g) * u).to(Out.dtype.element_ty), mask=mask)


def swiglu_triton(gate, up):
    assert gate.shape == up.shape
    gate, up = gate.contiguous(), up.contiguous()
    out = alloc(gate.shape, gate.dtype, gate.device)
    block = 1024
    _swiglu_kernel[(triton.cdiv(gate.numel(), block),)](gate, up, out, gate.numel(), BLOCK=block, num_warps=4)
    return out


def swiglu(gate, up):
    """silu(gate) * up for same-shaped tensors."""
    if use_triton(gate, up) and not needs_grad(gate, up):
        return swiglu_triton(gate, up)
    return F.silu(gate) * up
