"""KV-cache write: scatter the new tokens' K/V into the paged pools (vLLM's reshape_and_cache).

slot_mapping[t] = block * block_size + offset is the pool slot of token t (the scheduler computed it
from the block table); -1 marks a padding token that must not be written. One program copies one
token's [Hkv, D] rows of k and v; the store casts to the pool dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._utils import next_pow2, use_triton
from .cpu_extension import loaded_cpu_kernels


@triton.jit
def _reshape_and_cache_kernel(
    K,
    V,
    KCache,
    VCache,
    SlotMapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    row = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
    dst = row + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_heads, head_dim = k.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(head_dim),
        PAGE_SIZE=k_cache.shape[1],
        num_warps=4,
    )


def reshape_and_cache_torch(k, v, k_cache, v_cache, slot_mapping) -> None:
    """CPU path: one indexed copy into the pools viewed as [num_slots, Hkv, D]."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """In place: k/v [T, Hkv, D] into pools [num_blocks, block_size, Hkv, D] at slot_mapping [T] int64."""
    if use_triton(k, k_cache):
        return reshape_and_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    cpu = loaded_cpu_kernels(k, v, k_cache, v_cache)
    if cpu is not None and k.stride(1) == v.stride(1) == k.shape[2] and k_cache.is_contiguous():  # serving on CPU
        return cpu.cache_write(k, v, k_cache, v_cache, slot_mapping.contiguous())
    reshape_and_cache_torch(k, v, k_cache, v_cache, slot_mapping)
