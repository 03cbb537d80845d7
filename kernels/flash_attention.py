"""FlashAttention-2 forward for prefill: packed variable-length sequences, causal, GQA, sliding window,
and an optional prefix that already sits in the paged KV cache (chunked prefill / prefix caching).

One program owns BLOCK_M queries of one head of one sequence and streams that sequence's keys and
values once, BLOCK_N at a time, through the online softmax (online_softmax.attend_tile): the
S x S score matrix never exists. Only the key tiles a query block can see are visited (causal upper
bound, sliding-window lower bound). With a paged prefix the loop first walks the cached tokens
through the block table, then the new tokens in k/v. Queries are bottom-right aligned: query i of
a sequence with q_len queries and k_len keys (prefix included) sits at position k_len - q_len + i.
Soft-capping (SOFTCAP) caps each tile's scores before the mask (online_softmax); attention sinks
(SINKS) join each row's denominator once, in the epilogue: out * sigmoid(lse - sink), and the lse
saved for the backward pass includes the sink.

The backward pass (training) is in flash_attention_bwd.py; FlashAttnVarlen wires both into autograd.
The torch paths (CPU) are in attention_torch.py; their public names are importable from here too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import LOG2E, alloc, dot_precision, next_pow2, use_triton
from .attention_torch import check_window, flash_attn_varlen_torch, flash_attn_with_paged_prefix_torch
from .online_softmax import attend_tile, score_scales

__all__ = [
    "FlashAttnVarlen",
    "flash_attn_fwd_triton",
    "flash_attn_varlen",
    "flash_attn_varlen_torch",
    "flash_attn_varlen_triton",
    "flash_attn_with_paged_prefix",
    "flash_attn_with_paged_prefix_torch",
    "flash_attn_with_paged_prefix_triton",
]


@triton.jit
def _flash_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    CuQ,
    CuK,
    KCache,
    VCache,
    BlockTables,
    PrefixLens,
    Sinks,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_lh,
    qk_scale,
    cap,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    STORE_LSE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
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
    if PAGED:
        prefix = tl.load(PrefixLens + seq)
    else:
        prefix = 0
    kv_head = head // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < q_len
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    total = prefix + k_len
    q_pos = total - q_len + offs_m
    hi = total  # keys at positions [lo, hi) may be visible to this query block
    if CAUSAL:
        hi = tl.minimum(total, total - q_len + (pid_m + 1) * BLOCK_M)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(0, total - q_len + pid_m * BLOCK_M - window + 1)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if PAGED:  # cached prefix: positions [0, prefix), found through the block table
        prefix_hi = tl.minimum(hi, prefix)
        for start in range(lo, prefix_hi, BLOCK_N):
            k_pos = start + offs_n
            k_ok = k_pos < prefix_hi
            block = tl.load(BlockTables + seq * stride_bt + k_pos // PAGE_SIZE, mask=k_ok, other=0)
            slot = block.to(tl.int64) * stride_cb + (k_pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(KCache + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(VCache + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, k, v, q_pos, k_pos, k_ok, qk_scale, window, CAUSAL, WINDOWED, PRECISION, cap, SOFTCAP
            )

    new_lo = 0
    if WINDOWED:
        new_lo = tl.maximum(lo - prefix, 0)
    for start in range(new_lo, hi - prefix, BLOCK_N):  # keys in k/v, at positions prefix + j
        j = start + offs_n
        k_ok = j < k_len
        kv_rows = (k_start + j).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k, v, q_pos, prefix + j, k_ok, qk_scale, window, CAUSAL, WINDOWED, PRECISION, cap, SOFTCAP
        )

    # Rows that see no key at all (only possible when q_len > k_len) output zeros and lse -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = m_i + tl.log2(l_safe)
    if SINKS:  # the sink (log2 units) joins the denominator: out * sigmoid(lse - sink), lse += the sink's share
        sink = tl.load(Sinks + head)
        out = out / (1.0 + tl.exp2(sink - lse))[:, None]
        lse = tl.maximum(lse, sink) + tl.log2(1.0 + tl.exp2(-tl.abs(lse - sink)))
    tl.store(
        Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )
    if STORE_LSE:  # log2-sum-exp2 of the scaled scores, for the backward pass
        tl.store(Lse + head * stride_lh + q_start + offs_m, lse, mask=m_ok)


def fwd_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): bigger query tiles amortise K/V loads; fp32 (ieee dots) is small."""
    if dtype == torch.float32:
        return 32, 32, 4
    return (128, 64, 8) if head_dim > 64 else (64, 64, 4)


def flash_attn_fwd_triton(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    *,
    causal=True,
    sliding_window=None,
    softmax_scale=None,
    paged_prefix=None,
    with_lse=False,
    sinks=None,
    softcap=0.0,
):
    """Launch the forward kernel; returns (out [T, Hq, D], lse [Hq, T] in log2 units or None).

    paged_prefix = (k_cache, v_cache, block_tables, prefix_lens) switches on the cached-prefix loop;
    sinks [Hq] (any float dtype) and softcap > 0 switch on attention sinks and soft-capping.
    """
    check_window(causal, sliding_window)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    out = alloc(q.shape, q.dtype, q.device)
    lse = alloc((num_heads, total_q), torch.float32, q.device) if with_lse else out
    if paged_prefix is not None:
        k_cache, v_cache, block_tables, prefix_lens = paged_prefix
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        page_size = k_cache.shape[1]
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    else:
        k_cache = v_cache = block_tables = prefix_lens = cu_seqlens_q  # placeholders, never read
        page_size, cache_strides = 1, (0, 0, 0, 0)
    block_m, block_n, num_warps = fwd_config(q.dtype, head_dim)
    qk_scale, cap = score_scales(scale, softcap)
    sinks2 = (sinks.float() * LOG2E).contiguous() if sinks is not None else cu_seqlens_q  # else never read
    grid = (triton.cdiv(max_seqlen_q, block_m), num_heads, batch)
    _flash_fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        k_cache,
        v_cache,
        block_tables,
        prefix_lens,
        sinks2,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        *cache_strides,
        lse.stride(0) if with_lse else 0,
        qk_scale,
        cap,
        sliding_window or 0,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        WINDOWED=sliding_window is not None,
        PAGED=paged_prefix is not None,
        PAGE_SIZE=page_size,
        STORE_LSE=with_lse,
        PRECISION=dot_precision(q.dtype),
        SOFTCAP=bool(softcap),
        SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=2,
    )
    return out, (lse if with_lse else None)


class FlashAttnVarlen(torch.autograd.Function):
    """Triton forward + Triton backward (flash_attention_bwd) for training on packed sequences."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        sliding_window,
        softmax_scale,
        sinks=None,
        softcap=0.0,
    ):
        out, lse = flash_attn_fwd_triton(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            causal=causal,
            sliding_window=sliding_window,
            softmax_scale=softmax_scale,
            with_lse=True,
            sinks=sinks,
            softcap=softcap,
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks)
        ctx.args = (max_seqlen_q, max_seqlen_k, causal, sliding_window, softmax_scale, softcap)
        return out

    @staticmethod
    def backward(ctx, dout):
        from .flash_attention_bwd import flash_attn_bwd_triton

        q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
        max_q, max_k, causal, window, scale, softcap = ctx.args
        dq, dk, dv = flash_attn_bwd_triton(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cu_q,
            cu_k,
            max_q,
            max_k,
            causal=causal,
            sliding_window=window,
            softmax_scale=scale,
            softcap=softcap,
        )
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[10]:
            # d loss / d sink_h = -sum_i p_sink[h, i] D[i, h], D = rowsum(dO * O), p_sink = 2^(sink - lse)
            delta = (dout.float() * out.float()).sum(-1).T  # [Hq, T], like lse
            p_sink = torch.exp2(sinks.float()[:, None] * LOG2E - lse)
            dsinks = -(p_sink * delta).sum(1).to(sinks.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, dsinks, None


def flash_attn_varlen_triton(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=True,
    sliding_window=None,
    softmax_scale=None,
    sinks=None,
    softcap=0.0,
):
    """Triton path (differentiable, sinks included)."""
    return FlashAttnVarlen.apply(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        sliding_window,
        softmax_scale,
        sinks,
        softcap,
    )


def flash_attn_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=True,
    sliding_window=None,
    softmax_scale=None,
    sinks=None,
    softcap=0.0,
):
    """Attention over packed sequences: q [Tq, Hq, D], k/v [Tk, Hkv, D], cu_seqlens int32 [B+1].
    sinks [Hq]: attention sinks (gpt-oss); softcap > 0: logit soft-capping (Gemma 2/3)."""
    impl = flash_attn_varlen_triton if use_triton(q, k, v) else flash_attn_varlen_torch
    return impl(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        sliding_window=sliding_window,
        softmax_scale=softmax_scale,
        sinks=sinks,
        softcap=softcap,
    )


def flash_attn_with_paged_prefix_triton(
    q,
    k,
    v,
    cu_seqlens_q,
    k_cache,
    v_cache,
    block_tables,
    prefix_lens,
    max_seqlen_q,
    *,
    causal=True,
    sliding_window=None,
    softmax_scale=None,
    sinks=None,
    softcap=0.0,
):
    """Triton path (inference only): new tokens attend to their cached prefix and to themselves."""
    out, _ = flash_attn_fwd_triton(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_q,
        max_seqlen_q,
        causal=causal,
        sliding_window=sliding_window,
        softmax_scale=softmax_scale,
        paged_prefix=(k_cache, v_cache, block_tables, prefix_lens),
        sinks=sinks,
        softcap=softcap,
    )
    return out


def flash_attn_with_paged_prefix(
    q,
    k,
    v,
    cu_seqlens_q,
    k_cache,
    v_cache,
    block_tables,
    prefix_lens,
    max_seqlen_q,
    *,
    causal=True,
    sliding_window=None,
    softmax_scale=None,
    sinks=None,
    softcap=0.0,
):
    """Prefill of new tokens q/k/v [T, H, D] (packed by cu_seqlens_q) whose sequences already have
    prefix_lens[b] tokens in the paged pools k_cache/v_cache [num_blocks, block_size, Hkv, D]."""
    impl = flash_attn_with_paged_prefix_triton if use_triton(q, k, v) else flash_attn_with_paged_prefix_torch
    return impl(
        q,
        k,
        v,
        cu_seqlens_q,
        k_cache,
        v_cache,
        block_tables,
        prefix_lens,
        max_seqlen_q,
        causal=causal,
        sliding_window=sliding_window,
        softmax_scale=softmax_scale,
        sinks=sinks,
        softcap=softcap,
    )
