"""Weight-only quantised matmuls, y = x @ dequant(W)^T with 16/32-bit activations: W8A16 (int8
per-channel), W4A16 (int4 group-wise, packed) and fp8 e4m3 per-channel. Formats: quant.py.

One tiled GEMM kernel serves all three. Each program owns a [BLOCK_M, BLOCK_N] output tile and walks
K in BLOCK_K steps: it loads the quantised weight tile (1 byte, or half a byte, per weight instead of
2: the point of the exercise, decode GEMMs are bandwidth-bound on weights), dequantises it in
registers to the activation dtype and feeds tl.dot. Per-channel scales are applied once to the fp32
accumulator at the end; int4 group scales/zeros change along K, so BLOCK_K divides group_size and
each tile applies the single (scale, zero) of its group before the dot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import alloc, dot_precision, needs_grad, use_triton
from .reference import dequantize_int4

INT8, INT4, FP8 = 0, 1, 2


@triton.jit
def _weight_only_matmul_kernel(
    X,
    W,
    Scales,
    Zeros,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    FORMAT: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)  # fastest: neighbouring programs share the activation tile in L2
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_rows + k0 + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if FORMAT == 1:  # int4: [BLOCK_N, BLOCK_K / 2] bytes -> [BLOCK_N, BLOCK_K] nibbles, one group
            offs_kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_rows + offs_kp[None, :], mask=n_ok[:, None], other=0)
            q = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)
            group = k0 // GROUP_SIZE
            scale = tl.load(Scales + offs_n * stride_sn + group, mask=n_ok, other=0.0)
            zero = tl.load(Zeros + offs_n * stride_sn + group, mask=n_ok, other=0.0)
            w = ((q - zero[:, None]) * scale[:, None]).to(x.dtype)
        else:  # int8 / fp8 bytes; the per-channel scale comes after the loop
            b = tl.load(w_rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            if FORMAT == 2:  # e4m3 bits -> fp16 bits (exponent bias 7 -> 15, i.e. x 2^-8), exact
                bits = ((b & 0x80).to(tl.int16) << 8) | ((b & 0x7F).to(tl.int16) << 7)
                w = (bits.to(tl.float16, bitcast=True) * 256.0).to(x.dtype)
            else:
                w = b.to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if FORMAT != 1:
        acc = acc * tl.load(Scales + offs_n, mask=n_ok, other=0.0)[None, :]
    out_ptr = Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch(x, w, scales, zeros, fmt: int, group_size: int, n: int):
    """x [..., K] -> [..., n]; 16-row tiles for decode-sized M, bigger ones for prefill."""
    k = x.shape[-1]
    assert w.stride(-1) == 1 and scales.stride(-1) == 1
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    out = alloc((m, n), x.dtype, x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_k = min(group_size, 64) if fmt == INT4 else 64
    grid = (triton.cdiv(n, 64), triton.cdiv(m, block_m))
    _weight_only_matmul_kernel[grid](
        x2,
        w,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        x2.stride(0),
        w.stride(0),
        scales.stride(0),
        out.stride(0),
        FORMAT=fmt,
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype),
        num_warps=4,
        num_stages=3,
    )
    return out.view(*x.shape[:-1], n)


def int8_weight_matmul_triton(x, w_int8, scales):
    return _launch(x, w_int8, scales, scales, INT8, 1, w_int8.shape[0])


def int4_weight_matmul_triton(x, w_packed, scales, zeros, group_size):
    assert x.shape[-1] % group_size == 0 and group_size >= 16 and group_size & (group_size - 1) == 0
    assert scales.stride() == zeros.stride()
    return _launch(x, w_packed, scales, zeros, INT4, group_size, w_packed.shape[0])


def fp8_weight_matmul_triton(x, w_fp8, scales):
    # Bytes in, decoded in the kernel: sm_80 has no e4m3 type and the bit trick is exact everywhere.
    return _launch(x, w_fp8.view(torch.uint8), scales, scales, FP8, 1, w_fp8.shape[0])


def int8_weight_matmul_torch(x, w_int8, scales):
    """CPU path: torch's int8-weight GEMM kernel (dequantises on the fly, scales in x.dtype). It has
    no derivative, so a differentiable x goes through F.linear on the dequantised weight instead."""
    if needs_grad(x):
        return F.linear(x, (w_int8.float() * scales.float()[:, None]).to(x.dtype))
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch._weight_int8pack_mm(x2, w_int8.contiguous(), scales.to(x.dtype))
    return out.view(*x.shape[:-1], w_int8.shape[0])


def int4_weight_matmul_torch(x, w_packed, scales, zeros, group_size):
    """CPU path: dequantise then matmul (torch's int4 CPU kernel wants its own packing and zero convention)."""
    return F.linear(x, dequantize_int4(w_packed, scales, zeros, group_size).to(x.dtype))


def fp8_weight_matmul_torch(x, w_fp8, scales):
    return F.linear(x, (w_fp8.to(torch.float32) * scales[:, None]).to(x.dtype))


def _dispatch(triton_impl, torch_impl, x, w, *args):
    if use_triton(x, w) and not needs_grad(x):
        return triton_impl(x, w, *args)
    return torch_impl(x, w, *args)


def int8_weight_matmul(x, w_int8, scales):
    """W8A16: x [..., K] @ (w_int8 [N, K] * scales [N, None])^T."""
    return _dispatch(int8_weight_matmul_triton, int8_weight_matmul_torch, x, w_int8, scales)


def int4_weight_matmul(x, w_packed, scales, zeros, group_size):
    """W4A16: x [..., K] @ dequant(w_packed [N, K/2], scales/zeros [N, K/group_size])^T."""
    return _dispatch(int4_weight_matmul_triton, int4_weight_matmul_torch, x, w_packed, scales, zeros, group_size)


def fp8_weight_matmul(x, w_fp8, scales):
    """FP8 weight-only: x [..., K] @ (w_fp8 e4m3 [N, K] * scales [N, None])^T."""
    return _dispatch(fp8_weight_matmul_triton, fp8_weight_matmul_torch, x, w_fp8, scales)
