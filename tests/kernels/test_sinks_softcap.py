"""Attention sinks (gpt-oss: one logit per query head in every softmax's denominator, no value) and
logit soft-capping (Gemma 2/3: softcap * tanh(scores / softcap), before the mask) in every attention
path: the references against a plain float64 formula written out here, then the Triton kernels
(under the interpreter), the C++ CPU decode kernel and the torch paths against the references, with
GQA, sliding windows, empty rows, split-K, unified max, the tree tail mask and the backward pass."""

import pytest
import torch
from baton.kernels import flash_attention as fa
from baton.kernels import paged_attention as pa
from baton.kernels import reference as ref
from baton.kernels.attention_torch import attention_math

from .test_flash_attention import _cu
from .test_paged_attention import CPP, TOL, _decode_case

EXTRAS = {"sinks": (True, 0.0), "softcap": (False, 1.5), "both": (True, 1.5)}
LENS = [0, 1, 17, 70, 33]  # an empty slot, and lengths off the 16/32/64 tiles


def _sinks(num_heads: int) -> torch.Tensor:
    """Per-head sinks from negligible to dominant (scores here are ~N(0, 1) before the cap)."""
    base = torch.tensor([0.5, -30.0, 4.0, -1.0, 2.0, 0.0, 8.0, -3.0])
    return base.repeat(-(-num_heads // 8))[:num_heads]


def _kw(extras: str, num_heads: int) -> dict:
    with_sinks, softcap = EXTRAS[extras]
    return dict(sinks=_sinks(num_heads) if with_sinks else None, softcap=softcap)


def plain(q, k, v, keep, scale, sinks=None, softcap=0.0):
    """The formula, one query row at a time in float64: q [Lq, Hq, D], k/v [Lk, Hkv, D], keep [Lq, Lk]."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        s = q[:, h] @ k[:, h // group].T * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        sink = float(sinks[h]) if sinks is not None else float("-inf")
        for i in range(q.shape[0]):
            vis = keep[i]
            if not vis.any():
                continue  # sees no key: 0, sink or not
            m = max(float(s[i, vis].max()), sink)
            e = torch.exp(s[i, vis] - m)
            p = e / (e.sum() + torch.exp(torch.tensor(sink - m, dtype=torch.float64)))
            out[i, h] = p @ v[vis, h // group]
    return out


@pytest.mark.parametrize("extras", [*EXTRAS, "none"])
@pytest.mark.parametrize("mask", ["causal", "window", "noncausal"])
def test_references_match_the_plain_formula(extras, mask):
    kw = _kw(extras, 4) if extras != "none" else {}
    causal, window = mask != "noncausal", 3 if mask == "window" else None
    lq, lk = [2, 6, 5], [2, 9, 3]  # the last sequence's first 2 queries see no key
    q, k, v = torch.randn(sum(lq), 4, 16), torch.randn(sum(lk), 2, 16), torch.randn(sum(lk), 2, 16)
    got = ref.flash_attn_varlen_ref(
        *(t.double() for t in (q, k, v)), _cu(lq), _cu(lk), 6, 9, causal=causal, sliding_window=window, **kw
    )
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b in range(len(lq)):
        keep = ref.attention_mask(lq[b], lk[b], causal, window)
        want = plain(q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]], keep, 16**-0.5, **kw)
        torch.testing.assert_close(got[cq[b] : cq[b + 1]], want, atol=1e-12, rtol=1e-12)
    # decode: a one-token query over a paged cache, the same formula
    qd, kc, vc, tables, lens = _decode_case(torch.float64, [0, 1, 9], heads=(4, 2), head_dim=16, block_size=4)
    got = ref.paged_attention_decode_ref(qd, kc, vc, tables, lens, sliding_window=window, **kw)
    for b, n in enumerate(lens.tolist()):
        keys, vals = ref.gather_paged(kc, tables[b], n), ref.gather_paged(vc, tables[b], n)
        keep = ref.attention_mask(1, n, True, window)
        torch.testing.assert_close(got[b : b + 1], plain(qd[b : b + 1], keys, vals, keep, 16**-0.5, **kw))


def test_extras_change_the_result():
    """Each feature moves the output (so the tests below could fail), and sinks only shrink it."""
    args = _decode_case(torch.float64, [40], heads=(8, 2))
    base = ref.paged_attention_decode_ref(*args)
    for extras in EXTRAS:
        assert (ref.paged_attention_decode_ref(*args, **_kw(extras, 8)) - base).abs().max() > 1e-2
    with_sink = ref.paged_attention_decode_ref(*args, sinks=_sinks(8))
    assert (with_sink.norm(dim=-1) < base.norm(dim=-1)).all()


# ------------------------------------------------------------------------------------------ decode
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_triton(dtype, extras, window):
    """Direct (one split) and split-K + reduce, GQA, against the reference."""
    args = _decode_case(dtype, LENS, heads=(8, 2))
    kw = _kw(extras, 8)
    want = ref.paged_attention_decode_ref(*args, sliding_window=window, **kw)
    for num_splits in (1, 3):
        got = pa.paged_attention_decode_triton(*args, sliding_window=window, num_splits=num_splits, **kw)
        torch.testing.assert_close(got, want, **TOL[dtype])
        assert (got[0] == 0).all()  # the empty slot: zeros, sink or not


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the estimate that is too low
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (numpy, before the fallback)
@pytest.mark.parametrize("estimate", [1.0, -300.0])
def test_decode_triton_unified_max(estimate):
    args = _decode_case(torch.float32, LENS, heads=(8, 2))
    kw = _kw("both", 8)
    want = ref.paged_attention_decode_ref(*args, **kw)
    for num_splits in (1, 3):
        got = pa.paged_attention_decode_triton(*args, num_splits=num_splits, max_score_estimate=estimate, **kw)
        torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("window", [None, 50, 1])
@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=CPP), "torch"])
def test_decode_cpu_paths(impl, extras, window):
    """The C++ kernel (vector path for head_dim 64/128, portable loops for 48) and the torch path."""
    fn = pa.paged_attention_decode_cpu if impl == "cpu" else pa.paged_attention_decode_torch
    for heads, head_dim, block_size in [((8, 2), 64, 8), ((8, 1), 128, 16), ((6, 3), 48, 4)]:
        args = _decode_case(torch.float32, LENS + [130], heads, head_dim, block_size)
        kw = _kw(extras, heads[0])
        want = ref.paged_attention_decode_ref(*args, sliding_window=window, softmax_scale=0.2, **kw)
        got = fn(*args, sliding_window=window, softmax_scale=0.2, **kw)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
        assert (got[0] == 0).all()


@CPP
@pytest.mark.parametrize("extras", list(EXTRAS))
def test_decode_cpu_kernel_bfloat16(extras):
    """bfloat16 pools, queries and sinks (the model's dtype): float32 math, one rounding at the end."""
    for heads, head_dim in [((8, 2), 64), ((6, 3), 48)]:
        q, k_cache, v_cache, tables, ctx = _decode_case(torch.bfloat16, LENS + [130], heads, head_dim, 16)
        kw = _kw(extras, heads[0])
        if kw["sinks"] is not None:
            kw["sinks"] = kw["sinks"].bfloat16()
        for window in (None, 50):
            want = ref.paged_attention_decode_ref(
                q.float(), k_cache.float(), v_cache.float(), tables, ctx, sliding_window=window, **kw
            )
            got = pa.paged_attention_decode_cpu(q, k_cache, v_cache, tables, ctx, sliding_window=window, **kw)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2**-8)


@CPP
@pytest.mark.parametrize("extras", list(EXTRAS))
def test_decode_cpu_tail_mask(extras):
    """A speculative tree's rows (the C++ tree path): the tail mask hides tokens after the cap."""
    lens, tail_len = [5, 40, 17, 3], 6
    q, k_cache, v_cache, tables, ctx = _decode_case(torch.float32, lens, (8, 2))
    tail = torch.rand(len(lens), tail_len, generator=torch.Generator().manual_seed(1)) < 0.5
    tail[:, -1] = True
    kw = _kw(extras, 8)
    got = pa.paged_attention_decode_cpu(q, k_cache, v_cache, tables, ctx, softmax_scale=0.3, tail_mask=tail, **kw)
    for b, n in enumerate(lens):
        keep = torch.ones(1, n, dtype=torch.bool)
        seen = min(tail_len, n)
        keep[0, n - seen :] = tail[b, tail_len - seen :]
        keys, vals = ref.gather_paged(k_cache, tables[b], n), ref.gather_paged(v_cache, tables[b], n)
        want = ref._attend(q[b : b + 1], keys, vals, keep, 0.3, kw["sinks"], kw["softcap"])[0]
        torch.testing.assert_close(got[b], want, **TOL[torch.float32])


@CPP
def test_decode_cpu_kernel_checks_the_sinks():
    q, k_cache, v_cache, tables, ctx = _decode_case(torch.float32, [5, 9], (8, 2))
    with pytest.raises(RuntimeError, match="sinks"):
        pa.cpu_kernels().paged_decode(q, k_cache, v_cache, tables, ctx, 0.1, 0, None, torch.zeros(4), 0.0)


def test_dispatch_passes_the_extras():
    args = _decode_case(torch.float32, LENS, heads=(8, 2))
    kw = _kw("both", 8)
    torch.testing.assert_close(
        pa.paged_attention_decode(*args, **kw), ref.paged_attention_decode_ref(*args, **kw), **TOL[torch.float32]
    )


# ----------------------------------------------------------------------------------------- prefill
def _prefill(dtype, lens_q=(1, 20, 45), lens_k=(4, 20, 50), heads=(4, 2), head_dim=32):
    q = torch.randn(sum(lens_q), heads[0], head_dim, dtype=dtype)
    k = torch.randn(sum(lens_k), heads[1], head_dim, dtype=dtype)
    v = torch.randn(sum(lens_k), heads[1], head_dim, dtype=dtype)
    return q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k)


@pytest.mark.parametrize("mask", [(True, None), (True, 7), (False, None)])
@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_varlen(dtype, extras, mask):
    causal, window = mask
    args = _prefill(dtype)
    kw = dict(_kw(extras, 4), causal=causal, sliding_window=window)
    want = ref.flash_attn_varlen_ref(*args, **kw)
    out, lse = fa.flash_attn_fwd_triton(*args[:6], with_lse=True, **kw)
    torch.testing.assert_close(out, want, **TOL[dtype])
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(fa.flash_attn_varlen_torch(*args, **kw), want, **TOL[dtype])
    torch.testing.assert_close(fa.flash_attn_varlen(*args, **kw), want, **TOL[dtype])


def test_flash_varlen_rows_that_see_no_key():
    """q_len > k_len, causal: the first queries see nothing and give 0, with a sink too."""
    args = _prefill(torch.float32, lens_q=(6, 3), lens_k=(2, 3))
    kw = _kw("both", 4)
    want = ref.flash_attn_varlen_ref(*args, **kw)
    out, _ = fa.flash_attn_fwd_triton(*args[:6], **kw)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    assert out[:4].abs().max() == 0
    torch.testing.assert_close(fa.flash_attn_varlen_torch(*args, **kw), want, **TOL[torch.float32])


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_with_paged_prefix(dtype, extras, window):
    prefix, new, block_size = [0, 13, 30], [5, 8, 17], 8
    q, k, v, cu, _, mq, _ = _prefill(dtype, new, new)
    pool_k = torch.randn(12, block_size, 2, 32, dtype=dtype)
    pool_v = torch.randn_like(pool_k)
    tables = torch.randperm(12)[:12].view(3, 4).to(torch.int32)
    plens = torch.tensor(prefix, dtype=torch.int32)
    args = (q, k, v, cu, pool_k, pool_v, tables, plens, mq)
    kw = dict(_kw(extras, 4), sliding_window=window)
    want = ref.flash_attn_with_paged_prefix_ref(*args, **kw)
    torch.testing.assert_close(fa.flash_attn_with_paged_prefix_triton(*args, **kw), want, **TOL[dtype])
    torch.testing.assert_close(fa.flash_attn_with_paged_prefix_torch(*args, **kw), want, **TOL[dtype])


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_flash_backward(impl, extras):
    """dq, dk, dv and the sinks' own gradient, against autograd through the float64 reference."""
    args = _prefill(torch.float32, lens_q=(5, 37), lens_k=(5, 37))
    kw = dict(_kw(extras, 4), sliding_window=20)
    dout = torch.randn_like(args[0])
    fn = fa.flash_attn_varlen_triton if impl == "triton" else fa.flash_attn_varlen_torch
    grads = {}
    for name, dtype, f in (("got", torch.float32, fn), ("want", torch.float64, ref.flash_attn_varlen_ref)):
        leaves = [t.to(dtype).requires_grad_() for t in args[:3]]
        sinks = kw["sinks"].to(dtype).requires_grad_() if kw["sinks"] is not None else None
        if sinks is not None:
            leaves.append(sinks)
        out = f(*leaves[:3], *args[3:], **{**kw, "sinks": sinks})
        grads[name] = torch.autograd.grad(out, leaves, dout.to(dtype))
    for got, want in zip(grads["got"], grads["want"]):
        torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)


def test_attention_math_matches_the_reference_and_sdpa():
    """The torch paths' explicit core: with neither feature it is SDPA's attention (GQA without a
    repeat of K/V); with them, the reference's (a bool mask broadcast over batch and heads)."""
    q, k, v = torch.randn(2, 6, 5, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = ref.attention_mask(5, 9, True, 4)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(attention_math(q, k, v, 0.3, mask), sdpa, **TOL[torch.float32])
    kw = _kw("both", 6)
    got = attention_math(q, k, v, 0.3, mask, **kw)
    for b in range(2):
        want = ref._attend(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), mask, 0.3, **kw)
        torch.testing.assert_close(got[b].transpose(0, 1), want, **TOL[torch.float32])
