"""Paged decode attention's Triton path (paged_attention.py dispatches to it): FlashDecoding split-K,
plus the FlashDecoding++ unified-max variant.

Layout (vLLM): per-layer pools k_cache/v_cache [num_blocks, block_size, Hkv, D]; token t of
sequence b lives in block block_tables[b, t // block_size] at offset t % block_size.

Split-K: a decode step has only B x Hkv independent (sequence, kv-head) rows, far too few to fill a
GPU when B is small and contexts are long. Each row's keys are cut into num_splits chunks of
split_size tokens; program (b, kv_head, split) runs the online softmax over its chunk for all query
heads of the GQA group at once (they share K/V; the group is padded to 16 rows for tl.dot) and
writes a normalised partial output plus its log-sum-exp. The reduce kernel merges the partials:
out = sum_s o_s 2^(lse_s - lse), lse = log2 sum_s 2^lse_s. split_size is common to the batch, so a
short sequence simply uses fewer splits (the surplus programs exit at once): lengths may differ
wildly. With one split the kernel writes the final output itself and no reduce runs.

Unified max (FlashDecoding++): given an estimate phi of the largest scaled score (per head, from
calibration), a split computes p = 2^(s - phi) directly, with no running max, no rescaling of the
accumulator and no rowmax reduction per tile. p is kept in fp32 (its range is not [0, 1]) and
multiplied with V as fp32 (tf32 on tensor cores). If the estimate was wrong the split's sum l shows
it - l > 1e19 risks overflow, l < 1e-18 means precision was lost to underflow - and that split
alone is recomputed with the ordinary online softmax. The reduce is the same either way.

Soft-capping (SOFTCAP) caps each tile's scores (online_softmax). Attention sinks (SINKS) join each
row's denominator once: with one split the kernel scales its output by sigmoid(lse - sink), else the
reduce adds 2^(sink - lse_max) to its sum of split weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._utils import LOG2E, alloc, cdiv, dot_precision, next_pow2, num_sms
from .online_softmax import attend_tile, score_scales, scores


@triton.jit
def _split_softmax(
    q,
    KCache,
    VCache,
    BlockTables,
    seq,
    kv_head,
    start,
    end,
    m_init,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    qk_scale,
    cap,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNIFIED: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """(acc, m, l) of keys [start, end) of one sequence for the [BLOCK_H] query rows q."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = m_init
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n in range(start, end, BLOCK_N):
        pos = n + offs_n
        ok = pos < end
        block = tl.load(BlockTables + seq * stride_bt + pos // PAGE_SIZE, mask=ok, other=0)
        slot = block.to(tl.int64) * stride_cb + (pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(KCache + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(VCache + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UNIFIED:
            s = scores(q, k, qk_scale, cap, SOFTCAP, PRECISION)
            p = tl.where(ok[None, :], tl.exp2(s - m_i[:, None]), 0.0)
            l_i += tl.sum(p, 1)
            acc += tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        else:
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, k, v, pos, pos, ok, qk_scale, 0, False, False, PRECISION, cap, SOFTCAP
            )
    return acc, m_i, l_i


@triton.jit
def _paged_decode_kernel(
    Q,
    KCache,
    VCache,
    BlockTables,
    ContextLens,
    MaxEstimate,
    Sinks,
    Out,
    PartOut,
    PartLse,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_pb,
    stride_ph,
    stride_ps,
    qk_scale,
    cap,
    window,
    split_size,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    UNIFIED: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ContextLens + seq)
    lo = 0
    if WINDOWED:  # the query sits at ctx - 1 and sees keys > ctx - 1 - window
        lo = tl.maximum(ctx - window, 0)
    start = lo + split * split_size
    end = tl.minimum(start + split_size, ctx)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    hd_mask = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    out_ptr = Out + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if start >= end:  # surplus split of a short sequence, or an empty sequence
        if DIRECT:
            tl.store(out_ptr, tl.zeros([BLOCK_H, BLOCK_D], dtype=Out.dtype.element_ty), mask=hd_mask)
        return
    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=hd_mask, other=0.0)

    no_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    if UNIFIED:
        phi = tl.load(MaxEstimate + heads, mask=h_ok, other=0.0)  # log2 units, like the scores
        acc, m_i, l_i = _split_softmax(
            q,
            KCache,
            VCache,
            BlockTables,
            seq,
            kv_head,
            start,
            end,
            phi,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_bt,
            qk_scale,
            cap,
            BLOCK_H,
            BLOCK_D,
            HEAD_DIM,
            PAGE_SIZE,
            BLOCK_N,
            True,
            PRECISION,
            SOFTCAP,
        )
        bad = h_ok & ((l_i > 1e19) | (l_i < 1e-18) | (l_i != l_i))
        if tl.max(bad.to(tl.int32), 0) > 0:  # the estimate was off: redo this split the safe way
            acc, m_i, l_i = _split_softmax(
                q,
                KCache,
                VCache,
                BlockTables,
                seq,
                kv_head,
                start,
                end,
                no_max,
                stride_cb,
                stride_cs,
                stride_ch,
                stride_bt,
                qk_scale,
                cap,
                BLOCK_H,
                BLOCK_D,
                HEAD_DIM,
                PAGE_SIZE,
                BLOCK_N,
                False,
                PRECISION,
                SOFTCAP,
            )
    else:
        acc, m_i, l_i = _split_softmax(
            q,
            KCache,
            VCache,
            BlockTables,
            seq,
            kv_head,
            start,
            end,
            no_max,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_bt,
            qk_scale,
            cap,
            BLOCK_H,
            BLOCK_D,
            HEAD_DIM,
            PAGE_SIZE,
            BLOCK_N,
            False,
            PRECISION,
            SOFTCAP,
        )
    out = acc / l_i[:, None]  # every split holds at least one visible key, so l > 0
    if DIRECT:
        if SINKS:  # the sink (log2 units) joins the denominator: out * sigmoid(lse - sink)
            sink = tl.load(Sinks + heads, mask=h_ok, other=0.0)
            out = out / (1.0 + tl.exp2(sink - (m_i + tl.log2(l_i))))[:, None]
        tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=hd_mask)
    else:
        part = seq * stride_pb + heads * stride_ph + split * stride_ps  # PartOut is PartLse's shape + [D]
        tl.store(PartOut + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hd_mask)
        tl.store(PartLse + part, m_i + tl.log2(l_i), mask=h_ok)


@triton.jit
def _paged_decode_reduce_kernel(
    PartOut,
    PartLse,
    ContextLens,
    Sinks,
    Out,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    window,
    split_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WINDOWED: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ContextLens + seq)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(ctx - window, 0)
    n_splits = tl.cdiv(ctx - lo, split_size)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    d_ok = offs_d < HEAD_DIM
    out_ptr = Out + seq * stride_ob + head * stride_oh + offs_d
    if n_splits == 0:  # empty sequence (a padding slot of the batch): zeros
        tl.store(out_ptr, tl.zeros([BLOCK_D], dtype=Out.dtype.element_ty), mask=d_ok)
        return
    part = seq * stride_pb + head * stride_ph + offs_s
    lse = tl.load(PartLse + part, mask=s_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    w = tl.where(s_ok, tl.exp2(lse - lse_max), 0.0)
    o = tl.load(PartOut + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    denom = tl.sum(w, 0)
    if SINKS:  # the sink joins the denominator once, with no value
        denom += tl.exp2(tl.load(Sinks + head) - lse_max)
    out = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class SplitPlan:
    """How one decode step cuts each sequence's keys: num_splits chunks of split_size tokens."""

    num_splits: int
    split_size: int
    block_n: int


def plan_splits(
    batch: int, num_kv_heads: int, max_len: int, dtype: torch.dtype, device: torch.device, num_splits: int | None = None
) -> SplitPlan:
    """Enough splits for ~2 programs per SM (FlashDecoding), each split at least one key tile.

    max_len bounds the keys any sequence attends to; split_size is a multiple of the key tile."""
    block_n = 32 if dtype == torch.float32 else 64
    tiles = max(1, cdiv(max_len, block_n))
    if num_splits is None:
        num_splits = min(cdiv(2 * num_sms(device), batch * num_kv_heads), 64)
    num_splits = max(1, min(num_splits, tiles))
    split_size = cdiv(tiles, num_splits) * block_n
    return SplitPlan(cdiv(max_len, split_size) if max_len > 0 else 1, split_size, block_n)


def _max_len(block_tables, page_size, sliding_window, max_context_len) -> int:
    """Keys a sequence can attend to, known on the host without a device sync."""
    n = max_context_len if max_context_len is not None else block_tables.shape[1] * page_size
    return n if sliding_window is None else min(n, sliding_window)


def paged_attention_decode_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    *,
    softmax_scale=None,
    sliding_window=None,
    num_splits=None,
    max_context_len=None,
    max_score_estimate=None,
    sinks=None,
    softcap=0.0,
):
    """Triton path; max_score_estimate (float or [Hq] tensor, in scaled-score units, soft-capped
    ones where softcap is on) selects unified max. sinks [Hq]: attention sinks; softcap > 0: soft-capping."""
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    group = num_heads // num_kv_heads
    max_len = _max_len(block_tables, page_size, sliding_window, max_context_len)
    plan = plan_splits(batch, num_kv_heads, max_len, q.dtype, q.device, num_splits)
    direct = plan.num_splits == 1
    unified = max_score_estimate is not None
    if unified and not torch.is_tensor(max_score_estimate):
        max_score_estimate = torch.full((num_heads,), float(max_score_estimate), device=q.device)
    estimate = (max_score_estimate.float() * LOG2E).contiguous() if unified else context_lens  # else unused
    sinks2 = (sinks.float() * LOG2E).contiguous() if sinks is not None else context_lens  # else unused
    qk_scale, cap = score_scales(scale, softcap)

    out = alloc(q.shape, q.dtype, q.device)
    part_out = alloc((batch, num_heads, plan.num_splits, head_dim), torch.float32, q.device)
    part_lse = alloc((batch, num_heads, plan.num_splits), torch.float32, q.device)
    block_d = max(16, next_pow2(head_dim))
    _paged_decode_kernel[(batch, num_kv_heads, plan.num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        estimate,
        sinks2,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        qk_scale,
        cap,
        sliding_window or 0,
        plan.split_size,
        GROUP=group,
        BLOCK_H=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=plan.block_n,
        WINDOWED=sliding_window is not None,
        UNIFIED=unified,
        DIRECT=direct,
        PRECISION=dot_precision(q.dtype),
        SOFTCAP=bool(softcap),
        SINKS=sinks is not None,
        num_warps=4,
        num_stages=2,
    )
    if not direct:
        _paged_decode_reduce_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            context_lens,
            sinks2,
            out,
            out.stride(0),
            out.stride(1),
            part_lse.stride(0),
            part_lse.stride(1),
            sliding_window or 0,
            plan.split_size,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=next_pow2(plan.num_splits),
            WINDOWED=sliding_window is not None,
            SINKS=sinks is not None,
            num_warps=4,
        )
    return out
