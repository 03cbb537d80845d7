"""RMSNorm with an optional fused residual add (the pre-norm pattern of every Llama block).

One program normalises one row: it loads x (and the residual), writes h = x + residual back as the
new residual stream, reduces sum(h^2) in fp32 and writes (h * rsqrt(mean + eps)) * weight. Fusing
the add saves a full read and write of the hidden states per norm. Rounding follows HF
LlamaRMSNorm: the sum and the normalised value are rounded to the input dtype before the weight.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._utils import alloc, needs_grad, next_pow2, use_triton
from .cpu_extension import loaded_cpu_kernels
from .reference import rms_norm_ref


@triton.jit
def _rms_norm_kernel(
    X,
    Residual,
    W,
    Out,
    ResidualOut,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = h + tl.load(Residual + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(ResidualOut + row * stride_ro + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, 0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(h.dtype)
    tl.store(Out + row * stride_o + cols, (hf * rstd).to(h.dtype) * w, mask=mask)


def _rows(x):
    """[..., N] as a [rows, N] matrix with unit column stride (what the kernel indexes)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_triton(x, weight, eps=1e-6, residual=None):
    n = x.shape[-1]
    x2 = _rows(x)
    out = alloc(x2.shape, x.dtype, x.device)
    res2 = _rows(residual) if residual is not None else x2
    res_out = alloc(x2.shape, x.dtype, x.device) if residual is not None else out
    block = next_pow2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        res2,
        weight,
        out,
        res_out,
        x2.stride(0),
        res2.stride(0),
        out.stride(0),
        res_out.stride(0),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def _cpu_rows(t):
    """t itself when its leading dims collapse into one row stride (what the C++ kernel walks, e.g.
    a decode batch's rows), else a contiguous copy (a slice such as feats[:, 1:])."""
    if t.stride(-1) == 1:
        try:
            t.view(-1, t.shape[-1])
            return t
        except RuntimeError:
            pass
    return t.contiguous()


def rms_norm(x, weight, eps=1e-6, residual=None):
    """RMSNorm over the last dim; with residual returns (norm(x + residual), x + residual)."""
    if use_triton(x, weight) and not needs_grad(x, weight, *([residual] if residual is not None else [])):
        return rms_norm_triton(x, weight, eps, residual)
    cpu = loaded_cpu_kernels(x, weight, *([residual] if residual is not None else []))
    if cpu is not None:  # serving on CPU: one C++ pass (csrc/elementwise_cpu.cpp)
        out, h = cpu.rms_norm(_cpu_rows(x), weight, eps, None if residual is None else _cpu_rows(residual))
        return out if residual is None else (out, h)
    return rms_norm_ref(x, weight, eps, residual)
