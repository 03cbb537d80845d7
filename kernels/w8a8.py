"""W8A8 (SmoothQuant): int8 activations x int8 weights on the integer tensor cores.

quantize_per_token gives each activation row its own scale (max|x_row| / 127) at run time;
weights carry per-output-channel scales (quant.quantize_int8_per_channel, after smoothing). The GEMM
accumulates int8 x int8 products exactly in int32, and the epilogue applies both scales at once:
y[m, n] = acc[m, n] * x_scale[m] * w_scale[n]. Per-token x per-channel scales factor out of the K sum,
which is what lets the whole reduction stay in integers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import alloc, next_pow2, use_triton
from .quant import round_half_away


@triton.jit
def _quantize_per_token_kernel(X, Q, Scale, N, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-8) / 127.0
    y = x / scale
    q = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))  # round half away from zero
    tl.store(Q + row * stride_q + cols, tl.clamp(q, -127.0, 127.0).to(tl.int8), mask=mask)
    tl.store(Scale + row, scale)


@triton.jit
def _w8a8_matmul_kernel(
    A,
    B,
    AScale,
    BScale,
    Out,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = A + offs_m.to(tl.int64)[:, None] * stride_am
    b_rows = B + offs_n.to(tl.int64)[:, None] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_rows + k0 + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    a_scale = tl.load(AScale + offs_m, mask=m_ok, other=0.0)
    b_scale = tl.load(BScale + offs_n, mask=n_ok, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    out_ptr = Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quantize_per_token_triton(x):
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, n = x2.shape
    q = torch.empty((m, n), dtype=torch.int8, device=x.device)
    scales = alloc((m,), torch.float32, x.device)
    if m:
        block = next_pow2(n)
        _quantize_per_token_kernel[(m,)](
            x2, q, scales, n, x2.stride(0), q.stride(0), BLOCK=block, num_warps=min(16, max(1, block // 256))
        )
    return q.view(x.shape), scales.view(x.shape[:-1])


def quantize_per_token_torch(x):
    scales = x.float().abs().amax(dim=-1).clamp(min=1e-8) / 127.0
    q = round_half_away(x.float() / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_per_token(x):
    """x [..., K] float -> (int8 [..., K], fp32 scales [...]) with x ~ q * scale[..., None]."""
    return quantize_per_token_triton(x) if use_triton(x) else quantize_per_token_torch(x)


def w8a8_matmul_triton(x_int8, x_scales, w_int8, w_scales, out_dtype=torch.float16):
    k = x_int8.shape[-1]
    a = x_int8.reshape(-1, k).contiguous()
    m, n = a.shape[0], w_int8.shape[0]
    out = alloc((m, n), out_dtype, a.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    _w8a8_matmul_kernel[(triton.cdiv(n, 64), triton.cdiv(m, block_m))](
        a,
        w_int8,
        x_scales.reshape(-1).float(),
        w_scales.float(),
        out,
        m,
        n,
        k,
        a.stride(0),
        w_int8.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=64,
        num_warps=4,
        num_stages=3,
    )
    return out.view(*x_int8.shape[:-1], n)


def w8a8_matmul_torch(x_int8, x_scales, w_int8, w_scales, out_dtype=torch.float16):
    """CPU path: torch._int_mm (exact int32 accumulation), then the two scales."""
    a = x_int8.reshape(-1, x_int8.shape[-1])
    acc = torch._int_mm(a, w_int8.T)
    out = acc.float() * x_scales.reshape(-1, 1).float() * w_scales.float()[None, :]
    return out.to(out_dtype).view(*x_int8.shape[:-1], w_int8.shape[0])


def w8a8_matmul(x_int8, x_scales, w_int8, w_scales, out_dtype=torch.float16):
    """(x_int8 [..., K] @ w_int8 [N, K]^T) * x_scales[..., None] * w_scales[N] -> out_dtype [..., N]."""
    impl = w8a8_matmul_triton if use_triton(x_int8, w_int8) else w8a8_matmul_torch
    return impl(x_int8, x_scales, w_int8, w_scales, out_dtype)
