"""Paged attention for decode (one new query per sequence): the dispatcher, the torch path and the
C++ CPU kernel's entry. The Triton path (FlashDecoding split-K and FlashDecoding++'s unified max) is
paged_attention_triton.py; its public names are importable from here too.

Layout (vLLM): per-layer pools k_cache/v_cache [num_blocks, block_size, Hkv, D]; token t of
sequence b lives in block block_tables[b, t // block_size] at offset t % block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._utils import use_triton
from .attention_torch import attention_math
from .cpu_extension import cpu_kernels
from .paged_attention_triton import SplitPlan, paged_attention_decode_triton, plan_splits

__all__ = [
    "SplitPlan",
    "cpu_kernel_fits",
    "length_buckets",
    "paged_attention_decode",
    "paged_attention_decode_cpu",
    "paged_attention_decode_torch",
    "paged_attention_decode_triton",
    "plan_splits",
]


def length_buckets(lengths: list[int], max_waste: float = 2.0) -> list[list[int]]:
    """Batch rows grouped by similar length (longest first): within a group the longest row is at
    most max_waste times the shortest, so padding every row to its group's longest stays cheap."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] * max_waste >= lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def paged_attention_decode_torch(
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
    """CPU path: rows of similar length are gathered from the pools (index_select of whole blocks)
    into a padded batch, so a batch of wildly different lengths does not copy every row at the
    longest one's length; one SDPA call per group (each GQA group's query heads as rows against
    their kv head, a mask only when a row is shorter than its group's longest or a window applies).
    With sinks or softcap, the explicit attention_math core in place of SDPA."""
    extras = sinks is not None or bool(softcap)
    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_blocks, v_blocks = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    lens = context_lens.tolist()
    groups = length_buckets(lens)
    out = torch.empty_like(q) if len(groups) > 1 else None
    for rows in groups:
        n, width = len(rows), lens[rows[0]]
        idx = torch.tensor(rows, device=q.device) if out is not None else slice(None)  # one group: no copies
        if width == 0:  # empty slots (batch padding) attend to nothing
            o = torch.zeros(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
        else:
            nblocks = -(-width // page_size)
            blocks = block_tables[idx, :nblocks].long().clamp(min=0).flatten()
            shape = (n, nblocks * page_size, num_kv_heads, head_dim)
            keys = torch.index_select(k_blocks, 0, blocks).view(shape)[:, :width].transpose(1, 2)  # [n, Hkv, L, D]
            vals = torch.index_select(v_blocks, 0, blocks).view(shape)[:, :width].transpose(1, 2)
            mask = keep = None
            if any(lens[r] < width for r in rows) or (sliding_window is not None and sliding_window < width):
                pos = torch.arange(width, device=q.device)[None, :]
                ctx = context_lens[idx].long()[:, None]
                keep = pos < ctx
                if sliding_window is not None:
                    keep &= pos > ctx - 1 - sliding_window
                if not extras:
                    mask = torch.zeros(n, 1, 1, width, dtype=q.dtype, device=q.device).masked_fill_(
                        ~keep[:, None, None, :], float("-inf")
                    )
            if extras:
                scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
                keep = keep[:, None, None, :] if keep is not None else None
                o = attention_math(q[idx].view(n, num_heads, 1, head_dim), keys, vals, scale, keep, sinks, softcap)
            else:
                # the GQA group's query heads are G query rows against their shared kv head: no K/V repeat
                qg = q[idx].view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
                o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=softmax_scale)
            o = o.reshape(n, num_heads, head_dim)
        if out is None:
            return o
        out[idx] = o
    return out if out is not None else torch.empty_like(q)


def paged_attention_decode_cpu(
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
    tail_mask=None,
    sinks=None,
    softcap=0.0,
):
    """CPU path in C++ (csrc/paged_decode_cpu.cpp): reads K/V in place from the pools, no gather.
    float32 or bfloat16 (float32 math); splits and estimates change nothing. tail_mask [B, T] bool (CPU
    only, no window): row b sees token t >= context_lens[b] - T only where tail_mask[b, t - context_lens[b] + T].
    sinks [Hq] (any float dtype, cast to float32) and softcap > 0: attention sinks and soft-capping."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    tail = tail_mask.to(torch.uint8).contiguous() if tail_mask is not None else None
    sinks = sinks.detach().float().contiguous() if sinks is not None else None
    return cpu_kernels().paged_decode(
        q.contiguous(),
        k_cache,
        v_cache,
        block_tables.to(torch.int32),
        context_lens.to(torch.int32).contiguous(),
        scale,
        sliding_window or 0,
        tail,
        sinks,
        float(softcap or 0.0),
    )


def cpu_kernel_fits(q, k_cache, v_cache) -> bool:
    """True when the C++ CPU kernel can serve these tensors (float32 or bfloat16 on CPU, and it could be built)."""
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(-1) == 1
        and cpu_kernels() is not None
    )


def paged_attention_decode(
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
    """Decode attention: q [B, Hq, D] (one token per sequence, at position context_lens[b] - 1) over
    the paged pools. max_context_len (host int) sizes the splits without a device sync;
    max_score_estimate switches on FlashDecoding++'s unified max (Triton path only). sinks [Hq]:
    attention sinks (gpt-oss); softcap > 0: logit soft-capping (Gemma 2/3). CUDA runs the Triton
    kernel; CPU float32/bfloat16 the C++ kernel when it could be built; anything else the torch path."""
    if use_triton(q, k_cache):
        impl = paged_attention_decode_triton
    else:
        impl = paged_attention_decode_cpu if cpu_kernel_fits(q, k_cache, v_cache) else paged_attention_decode_torch
    return impl(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        softmax_scale=softmax_scale,
        sliding_window=sliding_window,
        num_splits=num_splits,
        max_context_len=max_context_len,
        max_score_estimate=max_score_estimate,
        sinks=sinks,
        softcap=softcap,
    )
