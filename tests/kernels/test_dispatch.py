"""The public dispatchers' Triton branch, which only CUDA tensors take: forcing `use_triton` on CPU
tensors runs it under the interpreter, so the wiring from each public function to its kernel
(argument order, keyword passing, autograd gating) is exercised without a GPU."""

import pytest
import torch

import baton.kernels as K
from baton.kernels import (
    activation,
    flash_attention,
    kv_cache,
    paged_attention,
    quant_matmul,
    reference as ref,
    rmsnorm,
    rotary,
    w8a8,
)
from baton.common.rope import inv_frequencies, rotary_cos_sin

MODULES = (activation, flash_attention, kv_cache, paged_attention, quant_matmul, rmsnorm, rotary, w8a8)
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture
def route(monkeypatch):
    """route(name): make every dispatcher take the Triton path, and record which *_triton ran."""
    ran = []
    for module in MODULES:
        monkeypatch.setattr(module, "use_triton", lambda *tensors: True)
        for name in (f"{public}_triton" for public in K.__all__ if hasattr(module, f"{public}_triton")):

            def spy(*args, _fn=getattr(module, name), _name=name, **kwargs):
                ran.append(_name)
                return _fn(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    return ran


def test_attention_dispatch(route):
    cu = torch.tensor([0, 5, 30], dtype=torch.int32)
    q, k, v = torch.randn(30, 4, 32), torch.randn(30, 2, 32), torch.randn(30, 2, 32)
    kw = dict(causal=True, sliding_window=7, softmax_scale=0.2)
    torch.testing.assert_close(
        K.flash_attn_varlen(q, k, v, cu, cu, 25, 25, **kw),
        ref.flash_attn_varlen_ref(q, k, v, cu, cu, 25, 25, **kw),
        **TOL,
    )
    cache = torch.randn(2, 3, 16, 2, 32)
    tables = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32)
    prefix = torch.tensor([20, 3], dtype=torch.int32)
    args = (q, k, v, cu, cache[0], cache[1], tables, prefix, 25)
    torch.testing.assert_close(
        K.flash_attn_with_paged_prefix(*args, **kw), ref.flash_attn_with_paged_prefix_ref(*args, **kw), **TOL
    )
    dargs = (q[:2], cache[0], cache[1], tables, prefix)
    dkw = dict(softmax_scale=0.2, sliding_window=9, num_splits=2, max_context_len=20, max_score_estimate=1.0)
    torch.testing.assert_close(
        K.paged_attention_decode(*dargs, **dkw), ref.paged_attention_decode_ref(*dargs, **dkw), **TOL
    )
    want_cache = cache.clone()
    slots = torch.tensor([5, -1, 40])
    K.reshape_and_cache(k[:3], v[:3], cache[0], cache[1], slots)
    ref.reshape_and_cache_ref(k[:3], v[:3], want_cache[0], want_cache[1], slots)
    torch.testing.assert_close(cache, want_cache, rtol=0, atol=0)
    assert route == [
        "flash_attn_varlen_triton",
        "flash_attn_with_paged_prefix_triton",
        "paged_attention_decode_triton",
        "reshape_and_cache_triton",
    ]


def test_elementwise_and_quant_dispatch(route):
    x, res = torch.randn(2, 3, 64)
    w = torch.rand(64)
    for got, want in zip(K.rms_norm(x, w, 1e-5, residual=res), ref.rms_norm_ref(x, w, 1e-5, residual=res)):
        torch.testing.assert_close(got, want, **TOL)
    q, k = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    cos, sin = rotary_cos_sin(inv_frequencies(16), torch.arange(4), torch.float32)
    for got, want in zip(K.apply_rotary(q, k, cos, sin), ref.apply_rotary_ref(q, k, cos, sin)):
        torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(K.swiglu(x, res), ref.swiglu_ref(x, res), **TOL)

    wt = torch.randn(24, 64)
    w8, s8 = K.quantize_int8_per_channel(wt)
    w4, s4, z4 = K.quantize_int4_groupwise(wt, 32)
    wf, sf = K.quantize_fp8_per_channel(wt)
    torch.testing.assert_close(K.int8_weight_matmul(x, w8, s8), ref.int8_weight_matmul_ref(x, w8, s8), **TOL)
    torch.testing.assert_close(
        K.int4_weight_matmul(x, w4, s4, z4, 32), ref.int4_weight_matmul_ref(x, w4, s4, z4, 32), **TOL
    )
    torch.testing.assert_close(K.fp8_weight_matmul(x, wf, sf), ref.fp8_weight_matmul_ref(x, wf, sf), **TOL)
    xq, xs = K.quantize_per_token(x)
    torch.testing.assert_close(
        K.w8a8_matmul(xq, xs, w8, s8, torch.float32), ref.w8a8_matmul_ref(xq, xs, w8, s8, torch.float32), **TOL
    )
    assert route == [
        "rms_norm_triton",
        "apply_rotary_triton",
        "swiglu_triton",
        "int8_weight_matmul_triton",
        "int4_weight_matmul_triton",
        "fp8_weight_matmul_triton",
        "quantize_per_token_triton",
        "w8a8_matmul_triton",
    ]


def test_inference_kernels_step_aside_for_autograd(route):
    """On 'CUDA' with gradients required, norms/rotary/SwiGLU/quant take the differentiable torch path;
    attention keeps its Triton kernel, which has a backward."""
    x = torch.randn(3, 64, requires_grad=True)
    w8, s8 = K.quantize_int8_per_channel(torch.randn(8, 64))
    (K.rms_norm(x, torch.ones(64)).sum() + K.swiglu(x, x).sum() + K.int8_weight_matmul(x, w8, s8).sum()).backward()
    assert route == [] and x.grad is not None
    cu = torch.tensor([0, 9], dtype=torch.int32)
    q = torch.randn(9, 2, 16, requires_grad=True)
    K.flash_attn_varlen(q, q, q, cu, cu, 9, 9).sum().backward()
    assert route == ["flash_attn_varlen_triton"] and torch.isfinite(q.grad).all()
