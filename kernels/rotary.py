"""Rotary position embedding (HF/Llama rotate_half layout) and its cos/sin tables, incl. llama3 scaling.

apply_rotary: out = x * cos + rotate_half(x) * sin, i.e. for the two halves x1, x2 of each head
    out1 = x1 * cos1 - x2 * sin1,   out2 = x2 * cos2 + x1 * sin2
with cos/sin [T, D] (= cat(freqs, freqs) per position). One program rotates every head of one token,
so the token's cos/sin row is loaded once for all heads; math in fp32.

The tables themselves (incl. llama3 scaling) come from baton.common.rope, the one place RoPE
frequencies are defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import alloc, needs_grad, next_pow2, use_triton
from .cpu_extension import loaded_cpu_kernels
from .reference import rotate_half


@triton.jit
def _rotary_kernel(
    X,
    Cos,
    Sin,
    Out,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_st,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    mask = (offs_h < NUM_HEADS)[:, None] & d_ok[None, :]
    c1 = tl.load(Cos + t * stride_ct + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(Cos + t * stride_ct + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(Sin + t * stride_st + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(Sin + t * stride_st + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    x_ptr = X + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    o_ptr = Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, (x1 * c1 - x2 * s1).to(Out.dtype.element_ty), mask=mask)
    tl.store(o_ptr + HALF, (x2 * c2 + x1 * s2).to(Out.dtype.element_ty), mask=mask)


def _rotate_triton(x, cos, sin):
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_tokens, num_heads, head_dim = x.shape
    out = alloc(x.shape, x.dtype, x.device)
    if num_tokens == 0:
        return out
    _rotary_kernel[(num_tokens,)](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=num_heads,
        HALF=head_dim // 2,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_HALF=next_pow2(head_dim // 2),
        num_warps=4,
    )
    return out


def apply_rotary_triton(q, k, cos, sin):
    assert cos.shape == sin.shape == (q.shape[0], q.shape[-1]), "cos/sin must be [T, head_dim]"
    cos, sin = cos.contiguous(), sin.contiguous()
    return _rotate_triton(q, cos, sin), _rotate_triton(k, cos, sin)


def apply_rotary_torch(q, k, cos, sin):
    c, s = cos[:, None, :], sin[:, None, :]
    return ((q * c.to(q.dtype) + rotate_half(q) * s.to(q.dtype)), (k * c.to(k.dtype) + rotate_half(k) * s.to(k.dtype)))


def apply_rotary(q, k, cos, sin):
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by per-token cos/sin [T, D]; returns new (q, k)."""
    if use_triton(q, k, cos) and not needs_grad(q, k):
        return apply_rotary_triton(q, k, cos, sin)
    cpu = loaded_cpu_kernels(q, k, cos, sin)
    if cpu is not None and q.dim() == 3 and cos.dim() == 2:  # serving on CPU: C++, float32 math, one rounding
        return cpu.rotary(q, k, cos, sin)
    return apply_rotary_torch(q, k, cos, sin)
