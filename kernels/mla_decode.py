"""Paged decode for multi-head latent attention (DeepSeek-V2/V3) over a latent-only cache, and the
cache write: the dispatchers, the torch path, the C++ CPU kernel's entry and the Triton kernels.

Layout: one pool per layer [num_blocks, block_size, L + R], token t of row b at block
block_tables[b, t // block_size], offset t % block_size; each row holds the token's compressed latent
(L = kv_lora_rank, after kv_a_layernorm) then its rotated rope key (R = qk_rope_head_dim).

With weight absorption (DeepSeek-V2 sec. 2.1.2) W_UK is folded into the query and W_UV applied after
attention, so every query head attends to the same cached row, which is its key (all L + R values)
and its value (the first L): multi-query attention with one (L + R)-wide head,
    out[t, h] = softmax_s(scale * q[t, h] . c_s) @ c_s[:L],   q[t, h] = cat(q_nope[h] @ W_UK[h], q_pe[h]).
The kernels read each cached row once for all heads (a GEMM of the row's heads against its cache, not
H dot products), and the latent is the only K/V stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import LOG2E, alloc, cdiv, dot_precision, next_pow2, num_sms, use_triton
from .cpu_extension import cpu_kernels, loaded_cpu_kernels
from .paged_attention import length_buckets
from .paged_attention_triton import _paged_decode_reduce_kernel

__all__ = [
    "mla_cache_write",
    "mla_cache_write_torch",
    "mla_cache_write_triton",
    "mla_cpu_kernel_fits",
    "paged_mla_decode",
    "paged_mla_decode_cpu",
    "paged_mla_decode_torch",
    "paged_mla_decode_triton",
]

BLOCK_H = 16  # query heads per program: the tl.dot rows (vLLM's MLA decode uses 16 as well)


def _check(q, cache, block_tables, context_lens, kv_lora_rank) -> None:
    """Shapes the kernels rely on, named when wrong (they would otherwise read out of bounds)."""
    if q.dim() != 3 or cache.dim() != 3 or q.shape[-1] != cache.shape[-1]:
        raise ValueError(
            f"paged_mla_decode: q must be [T, H, L + R] and the cache [blocks, block_size, L + R] of the same "
            f"width, got q {tuple(q.shape)} and cache {tuple(cache.shape)}"
        )
    if not 0 < kv_lora_rank <= q.shape[-1]:
        raise ValueError(f"paged_mla_decode: kv_lora_rank {kv_lora_rank} is not in [1, {q.shape[-1]}]")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(
            f"paged_mla_decode: one block table and context length per row ({q.shape[0]}), got tables "
            f"{tuple(block_tables.shape)} and lengths {tuple(context_lens.shape)}"
        )


# ------------------------------------------------------------------------------------------ decode
def paged_mla_decode_torch(
    q, cache, block_tables, context_lens, softmax_scale, kv_lora_rank, *, num_splits=None, max_context_len=None
):
    """Any device and dtype: rows of similar length gathered from the pool (whole blocks) into a padded
    batch, scores as one batched matmul of all heads against the shared rows, then p @ latent, all in
    float32 or wider (16-bit scores would cost a percent of each probability at L + R = 576). One group
    per length bucket, as paged_attention_decode_torch does; splits change nothing."""
    batch, heads, width = q.shape
    page = cache.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    blocks = cache.view(cache.shape[0], -1)
    lens = context_lens.tolist()
    out = torch.zeros(batch, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    for rows in length_buckets(lens):
        n, longest = len(rows), lens[rows[0]]
        if longest == 0:  # empty slots (batch padding) attend to nothing
            continue
        idx = torch.tensor(rows, device=q.device)
        nblocks = -(-longest // page)
        ids = block_tables[idx, :nblocks].long().clamp(min=0).flatten()
        kv = torch.index_select(blocks, 0, ids).view(n, nblocks * page, width)[:, :longest].to(acc)
        s = torch.bmm(q[idx].to(acc), kv.transpose(1, 2)) * softmax_scale  # [n, H, longest]
        if any(lens[r] < longest for r in rows):
            pos = torch.arange(longest, device=q.device)
            s.masked_fill_(pos[None, None, :] >= context_lens[idx].long()[:, None, None], float("-inf"))
        out[idx] = torch.bmm(torch.softmax(s, dim=-1), kv[..., :kv_lora_rank]).to(q.dtype)
    return out


def mla_cpu_kernel_fits(q, cache) -> bool:
    """True when the C++ CPU kernel can serve these tensors (float32 or bfloat16 on CPU, one dtype, and it
    could be built)."""
    return (
        q.device.type == "cpu"
        and q.dtype == cache.dtype
        and q.dtype in (torch.float32, torch.bfloat16)
        and cache.stride(-1) == 1
        and cpu_kernels() is not None
    )


def paged_mla_decode_cpu(
    q, cache, block_tables, context_lens, softmax_scale, kv_lora_rank, *, num_splits=None, max_context_len=None
):
    """The C++ kernel (csrc/mla_decode_cpu.cpp): reads the pool in place, each row's tokens once for all
    heads, one long row shared between the threads. float32 or bfloat16, float32 sums; splits change nothing."""
    return cpu_kernels().mla_decode(
        q.contiguous(),
        cache,
        block_tables.to(torch.int32),
        context_lens.to(torch.int32).contiguous(),
        float(softmax_scale),
        int(kv_lora_rank),
    )


@triton.jit
def _mla_decode_kernel(
    Q,
    Cache,
    BlockTables,
    ContextLens,
    Out,
    PartOut,
    PartLse,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_pb,
    stride_ph,
    stride_ps,
    qk_scale,
    split_size,
    NUM_HEADS: tl.constexpr,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (row, head block, split): the online softmax of BLOCK_H heads over the split's tokens.
    Each token tile is loaded once - latent [BLOCK_N, L] and rope key [BLOCK_N, R] - and serves as the
    keys of all the block's heads (two dots: q_lat . latent + q_pe . k_pe) and as their values."""
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    ctx = tl.load(ContextLens + row)
    start = split * split_size
    end = tl.minimum(start + split_size, ctx)
    h_ok = heads < NUM_HEADS
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < LORA
    r_ok = offs_r < ROPE
    out_mask = h_ok[:, None] & l_ok[None, :]
    out_ptr = Out + row * stride_ot + heads[:, None] * stride_oh + offs_l[None, :]
    if start >= end:  # surplus split of a short row, or an empty row
        if DIRECT:
            tl.store(out_ptr, tl.zeros([BLOCK_H, BLOCK_L], dtype=Out.dtype.element_ty), mask=out_mask)
        return
    q_row = Q + row * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=out_mask, other=0.0)
    q_pe = tl.load(q_row + LORA + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for n in range(start, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        ok = pos < end
        block = tl.load(BlockTables + row * stride_bt + pos // PAGE_SIZE, mask=ok, other=0)
        slot = block.to(tl.int64) * stride_cb + (pos % PAGE_SIZE) * stride_cs
        lat = tl.load(Cache + slot[:, None] + offs_l[None, :], mask=ok[:, None] & l_ok[None, :], other=0.0)
        pe = tl.load(Cache + slot[:, None] + LORA + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)
        s += tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))  # log2 units
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a token of the split
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    if DIRECT:
        tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=out_mask)
    else:  # PartOut is PartLse's shape + [L]; the reduce merges the splits
        part = row * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(PartOut + part[:, None] * LORA + offs_l[None, :], out, mask=out_mask)
        tl.store(PartLse + part, m_i + tl.log2(l_i), mask=h_ok)


def paged_mla_decode_triton(
    q, cache, block_tables, context_lens, softmax_scale, kv_lora_rank, *, num_splits=None, max_context_len=None
):
    """Triton path: FlashDecoding split-K over the rows' tokens (enough programs for ~2 per SM), the
    splits merged by paged decode's reduce kernel. max_context_len (host int) sizes the splits
    without a device sync; by default the block tables' capacity."""
    batch, heads, width = q.shape
    page = cache.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    assert cache.stride(-1) == 1, "the latent pool's rows must be contiguous"
    head_blocks = cdiv(heads, BLOCK_H)
    max_len = max_context_len if max_context_len is not None else block_tables.shape[1] * page
    # Key tiles: a [BLOCK_N, L] latent tile is the largest operand (L = 512: 32 KiB in 16 bits, staged
    # twice by the pipeline); float32 (tests, the interpreter) halves the tile to stay in shared memory.
    block_n = 16 if q.dtype == torch.float32 else 32
    tiles = max(1, cdiv(max_len, block_n))
    if num_splits is None:
        num_splits = min(cdiv(2 * num_sms(q.device), batch * head_blocks), 64)
    split_size = cdiv(tiles, max(1, min(num_splits, tiles))) * block_n
    num_splits = max(1, cdiv(max_len, split_size))
    direct = num_splits == 1
    out = alloc((batch, heads, kv_lora_rank), q.dtype, q.device)
    part_out = alloc((batch, heads, num_splits, kv_lora_rank), torch.float32, q.device)
    part_lse = alloc((batch, heads, num_splits), torch.float32, q.device)
    block_l = max(16, next_pow2(kv_lora_rank))
    rope = width - kv_lora_rank
    _mla_decode_kernel[(batch, head_blocks, num_splits)](
        q,
        cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        softmax_scale * LOG2E,
        split_size,
        NUM_HEADS=heads,
        LORA=kv_lora_rank,
        ROPE=rope,
        BLOCK_H=BLOCK_H,
        BLOCK_L=block_l,
        BLOCK_R=max(16, next_pow2(rope)),
        PAGE_SIZE=page,
        BLOCK_N=block_n,
        DIRECT=direct,
        PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    if not direct:
        _paged_decode_reduce_kernel[(batch, heads)](
            part_out,
            part_lse,
            context_lens,
            context_lens,  # Sinks: unused (SINKS=False)
            out,
            out.stride(0),
            out.stride(1),
            part_lse.stride(0),
            part_lse.stride(1),
            0,
            split_size,
            HEAD_DIM=kv_lora_rank,
            BLOCK_D=block_l,
            BLOCK_S=next_pow2(num_splits),
            WINDOWED=False,
            SINKS=False,
            num_warps=4,
        )
    return out


def paged_mla_decode(
    q, cache, block_tables, context_lens, softmax_scale, kv_lora_rank, *, num_splits=None, max_context_len=None
):
    """Absorbed MLA decode: q [T, H, L + R] = cat(q_nope @ W_UK, q_pe) per head, over the latent pool
    [num_blocks, block_size, L + R] -> [T, H, L] = softmax(scale * q . c) @ c[:, :L] over each row's
    first context_lens[t] tokens (itself included; 0: zeros). CUDA runs the Triton kernel; CPU float32
    and bfloat16 the C++ kernel when it could be built; anything else the torch path. num_splits and
    max_context_len only steer the Triton path."""
    _check(q, cache, block_tables, context_lens, kv_lora_rank)
    if use_triton(q, cache):
        impl = paged_mla_decode_triton
    else:
        impl = paged_mla_decode_cpu if mla_cpu_kernel_fits(q, cache) else paged_mla_decode_torch
    return impl(
        q,
        cache,
        block_tables,
        context_lens,
        softmax_scale,
        kv_lora_rank,
        num_splits=num_splits,
        max_context_len=max_context_len,
    )


# ------------------------------------------------------------------------------------ cache write
@triton.jit
def _mla_cache_write_kernel(
    Latent,
    KPe,
    Cache,
    SlotMapping,
    stride_lt,
    stride_rt,
    stride_cb,
    stride_cs,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    if slot < 0:
        return
    dst = Cache + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    lat = tl.load(Latent + t * stride_lt + offs_l, mask=offs_l < LORA)
    pe = tl.load(KPe + t * stride_rt + offs_r, mask=offs_r < ROPE)
    tl.store(dst + offs_l, lat.to(Cache.dtype.element_ty), mask=offs_l < LORA)
    tl.store(dst + LORA + offs_r, pe.to(Cache.dtype.element_ty), mask=offs_r < ROPE)


def mla_cache_write_triton(latent, k_pe, cache, slot_mapping) -> None:
    """One program per token copies its latent and rope key into its slot (casting to the pool's dtype)."""
    tokens, lora = latent.shape
    rope = k_pe.shape[1]
    assert cache.stride(-1) == 1, "the latent pool's rows must be contiguous"
    latent, k_pe = (x if x.stride(-1) == 1 else x.contiguous() for x in (latent, k_pe))
    if tokens == 0:
        return
    _mla_cache_write_kernel[(tokens,)](
        latent,
        k_pe,
        cache,
        slot_mapping,
        latent.stride(0),
        k_pe.stride(0),
        cache.stride(0),
        cache.stride(1),
        LORA=lora,
        ROPE=rope,
        BLOCK_L=next_pow2(lora),
        BLOCK_R=next_pow2(max(rope, 1)),
        PAGE_SIZE=cache.shape[1],
        num_warps=4,
    )


def mla_cache_write_torch(latent, k_pe, cache, slot_mapping) -> None:
    """One indexed copy into the pool viewed as [num_slots, L + R]."""
    keep = slot_mapping >= 0
    rows = torch.cat([latent, k_pe], dim=-1).to(cache.dtype)
    flat = cache.view(-1, cache.shape[-1])
    flat[slot_mapping[keep]] = rows[keep]


def mla_cache_write(latent, k_pe, cache, slot_mapping) -> None:
    """In place: latent [T, L] and rotated k_pe [T, R] into the pool [num_blocks, block_size, L + R] at
    slot_mapping [T] int64 (block * block_size + offset; -1 skips a padding token). CUDA: Triton; CPU
    float32/bfloat16 once the C++ kernels are loaded (serving): their row copy; else one torch index copy."""
    if latent.dim() != 2 or k_pe.dim() != 2 or cache.dim() != 3 or latent.shape[1] + k_pe.shape[1] != cache.shape[2]:
        raise ValueError(
            f"mla_cache_write: latent [T, L] and k_pe [T, R] into a pool [blocks, block_size, L + R], got "
            f"{tuple(latent.shape)}, {tuple(k_pe.shape)} and {tuple(cache.shape)}"
        )
    if use_triton(latent, cache):
        return mla_cache_write_triton(latent, k_pe, cache, slot_mapping)
    cpu = loaded_cpu_kernels(latent, k_pe, cache)
    if cpu is not None and latent.stride(1) == k_pe.stride(1) == 1 and cache.is_contiguous():
        return cpu.mla_cache_write(latent, k_pe, cache, slot_mapping.contiguous())
    mla_cache_write_torch(latent, k_pe, cache, slot_mapping)
