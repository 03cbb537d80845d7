"""Plain-torch references: the specification each kernel and each CPU fast path is tested against.

Written for clarity, not speed: loops over sequences, materialised masks, math in at least fp32
(fp64 inputs stay fp64, which is how tests check these against naive float64 formulas). Each
`*_ref` takes the same arguments as the public function of the same name (minus the suffix).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return softmax_scale if softmax_scale is not None else head_dim**-0.5


# ----------------------------------------------------------------------------------------- attention
def attention_mask(q_len: int, k_len: int, causal: bool, sliding_window: int | None, device=None) -> torch.Tensor:
    """[q_len, k_len] bool, True = visible. Query i sits at position k_len - q_len + i (bottom-right);
    key j is visible iff (causal) j <= i and (window) i - j < sliding_window, as in HF Mistral."""
    q_pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    k_pos = torch.arange(k_len, device=device)[None, :]
    keep = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        keep &= k_pos <= q_pos
    if sliding_window is not None:
        keep &= q_pos - k_pos < sliding_window
    return keep


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens [length, Hkv, D] of one sequence from a pool [blocks, block_size, Hkv, D]."""
    pos = torch.arange(length, device=cache.device)
    return cache[block_table[pos // cache.shape[1]].long(), pos % cache.shape[1]]


def _attend(q, k, v, keep, scale, sinks=None, softcap=0.0):
    """softmax(q k^T * scale, masked) v for one sequence; GQA by repeating kv heads; no key -> 0.

    softcap > 0 (Gemma 2/3): scores = softcap * tanh(scores / softcap), before the mask.
    sinks [Hq] (gpt-oss): one logit per query head that joins each softmax's denominator and has no
    value: p_j = exp(s_j - m) / (sum_j exp(s_j - m) + exp(sink - m)), m = max(max_j s_j, sink)."""
    group = q.shape[1] // k.shape[1]
    acc = _acc(q.dtype)
    k = k.to(acc).repeat_interleave(group, dim=1)
    v = v.to(acc).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    else:
        sink = sinks.to(acc)[:, None, None].expand(-1, s.shape[1], 1)  # [Hq, q, 1]
        m = torch.cat([s, sink], dim=-1).amax(dim=-1, keepdim=True)  # finite: the sink is
        e = torch.exp(s - m)
        p = e / (e.sum(dim=-1, keepdim=True) + torch.exp(sink - m))
    return torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)


def flash_attn_varlen_ref(
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
    scale = _scale(softmax_scale, q.shape[-1])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros_like(q)
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        keep = attention_mask(qs.stop - qs.start, ks.stop - ks.start, causal, sliding_window, q.device)
        out[qs] = _attend(q[qs], k[ks], v[ks], keep, scale, sinks, softcap)
    return out


def flash_attn_with_paged_prefix_ref(
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
    scale = _scale(softmax_scale, q.shape[-1])
    cq = cu_seqlens_q.tolist()
    out = torch.zeros_like(q)
    for b in range(len(cq) - 1):
        s, e, p = cq[b], cq[b + 1], int(prefix_lens[b])
        keys = torch.cat([gather_paged(k_cache, block_tables[b], p), k[s:e]])
        vals = torch.cat([gather_paged(v_cache, block_tables[b], p), v[s:e]])
        keep = attention_mask(e - s, p + e - s, causal, sliding_window, q.device)
        out[s:e] = _attend(q[s:e], keys, vals, keep, scale, sinks, softcap)
    return out


def paged_attention_decode_ref(
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
    """One new token per sequence at position context_lens[b] - 1; splits and estimates change nothing."""
    scale = _scale(softmax_scale, q.shape[-1])
    out = torch.zeros_like(q)
    for b, n in enumerate(context_lens.tolist()):
        keep = attention_mask(1, n, True, sliding_window, q.device)
        out[b] = _attend(
            q[b : b + 1],
            gather_paged(k_cache, block_tables[b], n),
            gather_paged(v_cache, block_tables[b], n),
            keep,
            scale,
            sinks,
            softcap,
        )[0]
    return out


def reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """In place: token t goes to pool slot slot_mapping[t] = block * block_size + offset; -1 skips."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = k[t]
            v_cache[slot // block_size, slot % block_size] = v[t]


def paged_mla_decode_ref(
    q, cache, block_tables, context_lens, softmax_scale, kv_lora_rank, *, num_splits=None, max_context_len=None
):
    """Absorbed MLA decode over the latent pool [blocks, block_size, L + R]: every head of a row
    attends to the same cached rows, out[t, h] = softmax_s(scale * q[t, h] . c_s) @ c_s[:L] over the
    row's first context_lens[t] tokens (none: zeros). [T, H, L + R] -> [T, H, L]; splits change nothing."""
    acc = _acc(q.dtype)
    out = torch.zeros(*q.shape[:2], kv_lora_rank, dtype=q.dtype, device=q.device)
    for t, n in enumerate(context_lens.tolist()):
        if n:
            rows = gather_paged(cache, block_tables[t], n).to(acc)  # [n, L + R]
            p = torch.softmax(q[t].to(acc) @ rows.T * softmax_scale, dim=-1)
            out[t] = (p @ rows[:, :kv_lora_rank]).to(q.dtype)
    return out


def mla_cache_write_ref(latent, k_pe, cache, slot_mapping) -> None:
    """In place: token t's latent [L] then k_pe [R] into slot slot_mapping[t] of the latent pool; -1 skips."""
    block_size, lora = cache.shape[1], latent.shape[-1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            cache[slot // block_size, slot % block_size, :lora] = latent[t]
            cache[slot // block_size, slot % block_size, lora:] = k_pe[t]


# ------------------------------------------------------------------------------------ elementwise
def rms_norm_ref(x, weight, eps=1e-6, residual=None):
    """HF LlamaRMSNorm, optionally after `x + residual` (then returns (out, x + residual))."""
    h = x if residual is None else x + residual
    hf = h.to(_acc(x.dtype))
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight.to(x.dtype)
    return y if residual is None else (y, h)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_ref(q, k, cos, sin):
    """HF/Llama rotate_half rotary: x * cos + rotate_half(x) * sin, cos/sin [T, D] broadcast over heads."""

    def rot(x):
        xa = x.to(_acc(x.dtype))
        c, s = cos[:, None, :].to(xa.dtype), sin[:, None, :].to(xa.dtype)
        return (xa * c + rotate_half(xa) * s).to(x.dtype)

    return rot(q), rot(k)


def swiglu_ref(gate, up):
    acc = _acc(gate.dtype)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


# ---------------------------------------------------------------------------------- quantized matmul
def unpack_int4(w_packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] values 0..15; column 2i is the low nibble of byte i, 2i+1 the high."""
    return torch.stack([w_packed & 0xF, w_packed >> 4], dim=-1).reshape(w_packed.shape[0], -1)


def dequantize_int4(w_packed, scales, zeros, group_size):
    """w[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g], in fp32."""
    q = unpack_int4(w_packed).float()
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    return (q - z) * s


def int8_weight_matmul_ref(x, w_int8, scales):
    """x [M, K] @ (w_int8 [N, K] * scales[N, None])^T -> [M, N] in x.dtype."""
    acc = _acc(x.dtype)
    return (x.to(acc) @ (w_int8.to(acc) * scales.to(acc)[:, None]).T).to(x.dtype)


def int4_weight_matmul_ref(x, w_packed, scales, zeros, group_size):
    acc = _acc(x.dtype)
    return (x.to(acc) @ dequantize_int4(w_packed, scales, zeros, group_size).to(acc).T).to(x.dtype)


def fp8_weight_matmul_ref(x, w_fp8, scales):
    acc = _acc(x.dtype)
    return (x.to(acc) @ (w_fp8.to(acc) * scales.to(acc)[:, None]).T).to(x.dtype)


def w8a8_matmul_ref(x_int8, x_scales, w_int8, w_scales, out_dtype=torch.float16):
    """(x_int8 @ w_int8^T, exact in int64) * x_scales[M, None] * w_scales[None, N]."""
    acc = (x_int8.long() @ w_int8.long().T).double()
    return (acc * x_scales.double()[:, None] * w_scales.double()[None, :]).to(out_dtype)


def ssd_scan_ref(x, dt, A, B, C, initial_state=None):
    """Mamba2's selective state-space recurrence, one token at a time (the specification the
    chunked scans are checked against): per head, h_t = exp(dt_t * A) h_{t-1} + dt_t x_t B_t^T,
    y_t = h_t C_t. x [b, l, h, p], dt [b, l, h], A [h], B and C [b, l, g, n] (heads share a
    group's B/C), initial_state [b, h, p, n]; returns (y [b, l, h, p], final state), float32."""
    b, length, heads, p = x.shape
    rep = heads // B.shape[2]
    Bh, Ch = (t.float().repeat_interleave(rep, dim=2) for t in (B, C))
    state = torch.zeros(b, heads, p, B.shape[-1]) if initial_state is None else initial_state.float()
    state = state.to(x.device)
    ys = []
    for t in range(length):
        step = dt[:, t].float()
        decay = torch.exp(step * A.float())[..., None, None]
        state = state * decay + (step[..., None] * x[:, t].float())[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    return torch.stack(ys, dim=1), state
