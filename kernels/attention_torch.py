"""The torch paths of prefill attention (flash_attention.py dispatches to them off CUDA) and the
explicit attention core every torch path falls back to for what SDPA cannot do: attention sinks
(gpt-oss: one learned logit per query head in each softmax's denominator, with no value) and logit
soft-capping (Gemma 2/3: scores = softcap * tanh(scores / softcap), before the mask). With neither,
the torch paths keep torch SDPA, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import attention_mask, gather_paged


def check_window(causal: bool, sliding_window: int | None) -> None:
    if sliding_window is not None and not causal:
        raise ValueError("sliding_window follows HF Mistral semantics and requires causal=True")


def attention_math(q, k, v, scale, mask=None, sinks=None, softcap=0.0):
    """softmax(q k^T * scale) v written out, in SDPA's layout: q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D]
    (each kv head serves Hq / Hkv consecutive query heads, without a repeat of K/V), mask bool
    broadcastable to [B, Hq, Lq, Lk] (True = visible). softcap > 0 caps the scaled scores before the
    mask; sinks [Hq] join each row's denominator. Math in at least fp32, the result in q's dtype; a
    row that sees no key gives 0 (as reference._attend). Differentiable, sinks included."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).reshape(b, hkv, hq // hkv, lq, d)
    s = (qg @ k.to(acc).unsqueeze(2).transpose(-1, -2)).reshape(b, hq, lq, lk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    else:  # the sink as one more column of the softmax, dropped before p @ V
        sink = sinks.to(acc).view(1, hq, 1, 1).expand(b, hq, lq, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :lk]
    o = p.reshape(b, hkv, hq // hkv, lq, lk) @ v.to(acc).unsqueeze(2)
    return o.reshape(b, hq, lq, v.shape[-1]).to(q.dtype)


def _sdpa(q, k, v, causal, sliding_window, scale, sinks=None, softcap=0.0):
    """[L, H, D] tensors of one sequence through torch SDPA (GQA handled by enable_gqa), or through
    attention_math when sinks or soft-capping are on."""
    q_len, k_len = q.shape[0], k.shape[0]
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if sinks is not None or softcap:
        mask = attention_mask(q_len, k_len, causal, sliding_window, q.device) if causal or sliding_window else None
        o = attention_math(qt, kt, vt, scale, mask, sinks, softcap)
    elif causal and sliding_window is None and q_len == k_len:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = attention_mask(q_len, k_len, causal, sliding_window, q.device)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def flash_attn_varlen_torch(
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
    """CPU path: torch SDPA per sequence (differentiable; with sinks or softcap the explicit core)."""
    check_window(causal, sliding_window)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = [
        _sdpa(
            q[cq[b] : cq[b + 1]],
            k[ck[b] : ck[b + 1]],
            v[ck[b] : ck[b + 1]],
            causal,
            sliding_window,
            scale,
            sinks,
            softcap,
        )
        for b in range(len(cq) - 1)
    ]
    return torch.cat(outs) if outs else torch.empty_like(q)


def flash_attn_with_paged_prefix_torch(
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
    """CPU path: gather each prefix from the pools, prepend it to the new keys, run SDPA (with sinks
    or softcap the explicit core)."""
    check_window(causal, sliding_window)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    cq, plens = cu_seqlens_q.tolist(), prefix_lens.tolist()
    outs = []
    for b in range(len(cq) - 1):
        s, e = cq[b], cq[b + 1]
        keys = torch.cat([gather_paged(k_cache, block_tables[b], plens[b]), k[s:e]])
        vals = torch.cat([gather_paged(v_cache, block_tables[b], plens[b]), v[s:e]])
        outs.append(_sdpa(q[s:e], keys, vals, causal, sliding_window, scale, sinks, softcap))
    return torch.cat(outs) if outs else torch.empty_like(q)
