"""FlashAttention prefill (varlen, paged prefix) and backward: Triton kernels under the interpreter
and the CPU dispatch path, both against the reference, in fp32 and fp16."""

import pytest
import torch

from baton.kernels import flash_attention as fa, reference as ref
from baton.kernels.flash_attention import flash_attn_varlen, flash_attn_with_paged_prefix

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
HEADS = {"mha": (2, 2, 32), "gqa": (4, 2, 64), "mqa": (3, 1, 16), "odd_dim": (2, 1, 40)}
MASKS = {"causal": (True, None), "noncausal": (False, None), "window": (True, 23)}


def _cu(lens):
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _varlen(dtype, heads, lens_q, lens_k):
    hq, hkv, d = HEADS[heads]
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype)
    k = torch.randn(sum(lens_k), hkv, d, dtype=dtype)
    v = torch.randn(sum(lens_k), hkv, d, dtype=dtype)
    return q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k)


# lengths straddle the 32/64-token tiles; the second set has fewer queries than keys (bottom-right)
LENGTHS = {"same": ([1, 37, 130], [1, 37, 130]), "shorter_q": ([1, 20, 70], [5, 37, 150])}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_fwd(dtype, heads, mask):
    causal, window = MASKS[mask]
    for lens_q, lens_k in LENGTHS.values():
        args = _varlen(dtype, heads, lens_q, lens_k)
        want = ref.flash_attn_varlen_ref(*args, causal=causal, sliding_window=window)
        out, lse = fa.flash_attn_fwd_triton(*args[:6], causal=causal, sliding_window=window, with_lse=True)
        torch.testing.assert_close(out, want, **TOL[dtype])
        assert torch.isfinite(lse).all()
        torch.testing.assert_close(flash_attn_varlen(*args, causal=causal, sliding_window=window), want, **TOL[dtype])


def test_flash_fwd_custom_scale_and_empty_rows():
    """softmax_scale is honoured; queries that see no key (q_len > k_len, causal) give zeros."""
    q, k, v, cu_q, cu_k, mq, mk = _varlen(torch.float32, "gqa", [6, 3], [2, 3])
    want = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=0.05)
    out, _ = fa.flash_attn_fwd_triton(q, k, v, cu_q, cu_k, mq, softmax_scale=0.05)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    assert out[:4].abs().max() == 0


def test_window_requires_causal():
    with pytest.raises(ValueError):
        flash_attn_varlen(*_varlen(torch.float32, "mha", [4], [4]), causal=False, sliding_window=2)


def _paged_case(dtype, heads, prefix, new, block_size):
    hq, hkv, d = HEADS[heads]
    num_blocks = sum(-(-p // block_size) for p in prefix) + 4
    k_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    max_blocks = max(1, max(-(-p // block_size) for p in prefix))
    perm = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.full((len(prefix), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, p in enumerate(prefix):
        n = -(-p // block_size)
        tables[b, :n] = perm[used : used + n]
        used += n
    q = torch.randn(sum(new), hq, d, dtype=dtype)
    k = torch.randn(sum(new), hkv, d, dtype=dtype)
    v = torch.randn(sum(new), hkv, d, dtype=dtype)
    return q, k, v, _cu(new), k_cache, v_cache, tables, torch.tensor(prefix, dtype=torch.int32), max(new)


@pytest.mark.parametrize("mask", ["causal", "window"])
@pytest.mark.parametrize("heads", ["gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_paged_prefix(dtype, heads, mask):
    causal, window = MASKS[mask]
    for block_size in (16, 5):
        args = _paged_case(dtype, heads, prefix=[0, 7, 40, 100], new=[3, 1, 50, 20], block_size=block_size)
        want = ref.flash_attn_with_paged_prefix_ref(*args, causal=causal, sliding_window=window)
        got = fa.flash_attn_with_paged_prefix_triton(*args, causal=causal, sliding_window=window)
        torch.testing.assert_close(got, want, **TOL[dtype])
        cpu = flash_attn_with_paged_prefix(*args, causal=causal, sliding_window=window)
        torch.testing.assert_close(cpu, want, **TOL[dtype])


def _grads(fn, q, k, v, dout, *args, **kwargs):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, *args, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.slow
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads", ["mha", "gqa", "odd_dim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_backward(dtype, heads, mask):
    causal, window = MASKS[mask]
    q, k, v, *rest = _varlen(dtype, heads, [1, 37, 90], [5, 37, 100])
    dout = torch.randn_like(q)
    kw = dict(causal=causal, sliding_window=window)
    want = _grads(ref.flash_attn_varlen_ref, q.double(), k.double(), v.double(), dout.double(), *rest, **kw)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for impl in (fa.flash_attn_varlen_triton, fa.flash_attn_varlen_torch):
        got = _grads(impl, q, k, v, dout, *rest, **kw)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.to(dtype), **tol)
