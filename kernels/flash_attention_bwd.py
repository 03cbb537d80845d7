"""FlashAttention-2 backward for packed variable-length sequences (causal, GQA, sliding window).

The forward saved only O and the log-sum-exp L per query row, so P = exp(S - L) is recomputed
tile by tile. With D_i = rowsum(dO * O) (preprocess kernel):

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale * dS K,   dK = scale * dS^T Q

Two kernels avoid atomics: one program per key block accumulates dK/dV over every query tile (and,
for GQA, every query head of its group) that can see it; one program per query block accumulates
dQ over the key tiles it sees. Scores are in log2 units like the forward.

Soft-capping (SOFTCAP): a score is softcap * tanh(x / softcap) of the scaled q.k = x, so dS is
multiplied by its derivative 1 - tanh^2 before dQ and dK. Attention sinks need nothing here: the
forward's lse includes the sink (so P is the sink-normalised one) and D = rowsum(dO * O) still holds;
the sinks' own gradient is computed from lse and D by the autograd function (flash_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import alloc, dot_precision, next_pow2
from .online_softmax import score_scales, tanh


@triton.jit
def _bwd_preprocess_kernel(
    Out,
    DOut,
    Delta,
    T,
    stride_ot,
    stride_oh,
    stride_dt,
    stride_dh,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < T)[:, None] & (offs_d < HEAD_DIM)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    o = tl.load(Out + r64 * stride_ot + head * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DOut + r64 * stride_dt + head * stride_dh + offs_d[None, :], mask=mask, other=0.0)
    tl.store(Delta + head * stride_lh + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < T)


@triton.jit
def _visible(q_pos, k_pos, q_ok, k_ok, window, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr):
    """[M, N] visibility of keys k_pos to queries q_pos (same rule as online_softmax.attend_tile)."""
    keep = q_ok[:, None] & k_ok[None, :]
    if CAUSAL:
        keep = keep & (k_pos[None, :] <= q_pos[:, None])
    if WINDOWED:
        keep = keep & (q_pos[:, None] - k_pos[None, :] < window)
    return keep


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DK,
    DV,
    CuQ,
    CuK,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_lh,
    qk_scale,
    cap,
    sm_scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """q/dO share strides (stride_q*), and so do k/v/dk/dv (stride_k*): the launcher makes them contiguous."""
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    k_start = tl.load(CuK + seq)
    k_len = tl.load(CuK + seq + 1) - k_start
    if pid_n * BLOCK_N >= k_len:
        return
    q_start = tl.load(CuQ + seq)
    q_len = tl.load(CuQ + seq + 1) - q_start
    shift = k_len - q_len  # query i sits at position shift + i

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < k_len
    kv_ptr = (k_start + offs_n).to(tl.int64)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_ptr, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_ptr, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    i_lo = 0  # query rows [i_lo, i_hi) can see some key of this block
    if CAUSAL:
        i_lo = tl.maximum(pid_n * BLOCK_N - shift, 0)
    i_hi = q_len
    if WINDOWED:
        i_hi = tl.minimum(q_len, (pid_n + 1) * BLOCK_N - 1 + window - shift)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for start in range(i_lo, i_hi, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            m_ok = offs_m < q_len
            q_ptr = (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + q_ptr, mask=q_mask, other=0.0)
            do = tl.load(DO + q_ptr, mask=q_mask, other=0.0)
            lse = tl.load(Lse + head * stride_lh + q_start + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(Delta + head * stride_lh + q_start + offs_m, mask=m_ok, other=0.0)
            # transposed tiles [BLOCK_N, BLOCK_M] so dK/dV accumulate with plain dots
            keep_t = tl.trans(_visible(shift + offs_m, offs_n, m_ok, n_ok, window, CAUSAL, WINDOWED))
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)
            if SOFTCAP:
                t_t = tanh(s_t * qk_scale)
                s_t = t_t * cap
            else:
                s_t = s_t * qk_scale
            p_t = tl.where(keep_t, tl.exp2(s_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:
                ds_t = ds_t * (1.0 - t_t * t_t)
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    tl.store(DK + kv_ptr, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_ptr, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DQ,
    CuQ,
    CuK,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_lh,
    qk_scale,
    cap,
    sm_scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(CuQ + seq)
    q_len = tl.load(CuQ + seq + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    k_start = tl.load(CuK + seq)
    k_len = tl.load(CuK + seq + 1) - k_start
    shift = k_len - q_len
    kv_head = head // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < q_len
    q_ptr = (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_ptr, mask=q_mask, other=0.0)
    do = tl.load(DO + q_ptr, mask=q_mask, other=0.0)
    lse = tl.load(Lse + head * stride_lh + q_start + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(Delta + head * stride_lh + q_start + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, shift + (pid_m + 1) * BLOCK_M)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(0, shift + pid_m * BLOCK_M - window + 1)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < k_len
        kv_ptr = (k_start + offs_n).to(tl.int64)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(K + kv_ptr, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + kv_ptr, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        keep = _visible(shift + offs_m, offs_n, m_ok, n_ok, window, CAUSAL, WINDOWED)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if SOFTCAP:
            t = tanh(s * qk_scale)
            s = t * cap
        else:
            s = s * qk_scale
        p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + q_ptr, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def bwd_config(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): dK/dV programs hold two [BLOCK_N, D] fp32 accumulators."""
    return (32, 32, 4) if dtype == torch.float32 else (64, 64, 4)


def flash_attn_bwd_triton(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=True,
    sliding_window=None,
    softmax_scale=None,
    softcap=0.0,
):
    """Gradients (dq, dk, dv) given the forward's output and its log2-sum-exp lse [Hq, Tq] (sinks
    included); softcap: the forward's soft-cap (0: off)."""
    q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    block_d = max(16, next_pow2(head_dim))
    block_m, block_n, num_warps = bwd_config(q.dtype)

    delta = alloc(lse.shape, torch.float32, q.device)
    _bwd_preprocess_kernel[(triton.cdiv(total_q, 64), num_heads)](
        out,
        dout,
        delta,
        total_q,
        out.stride(0),
        out.stride(1),
        dout.stride(0),
        dout.stride(1),
        delta.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=64,
    )

    dq, dk, dv = alloc(q.shape, q.dtype, q.device), alloc(k.shape, k.dtype, k.device), alloc(v.shape, v.dtype, v.device)
    common = dict(
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        WINDOWED=sliding_window is not None,
        PRECISION=dot_precision(q.dtype),
        SOFTCAP=bool(softcap),
        num_warps=num_warps,
        num_stages=2,
    )
    args = (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        lse.stride(0),
        *score_scales(scale, softcap),
        scale,
        sliding_window or 0,
    )
    _bwd_dkdv_kernel[(triton.cdiv(max_seqlen_k, block_n), num_kv_heads, batch)](
        q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, *args, **common
    )
    _bwd_dq_kernel[(triton.cdiv(max_seqlen_q, block_m), num_heads, batch)](
        q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, *args, **common
    )
    return dq, dk, dv
