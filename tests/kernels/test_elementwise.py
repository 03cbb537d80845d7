"""RMSNorm (+ fused residual), rotary (+ llama3 tables) and SwiGLU: Triton kernels under the
interpreter and the dispatchers' CPU paths against the references, in fp32 and fp16."""

import pytest
import torch

from baton.kernels import activation, reference as ref, rmsnorm, rotary
from baton.common.rope import inv_frequencies, rotary_cos_sin
from baton.kernels import apply_rotary, rms_norm, swiglu

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 100), (7, 1000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    residual = torch.randn(shape, dtype=dtype)
    w = torch.rand(shape[-1], dtype=dtype) + 0.5
    torch.testing.assert_close(rmsnorm.rms_norm_triton(x, w, 1e-5), ref.rms_norm_ref(x, w, 1e-5), **TOL[dtype])
    out, new_residual = rmsnorm.rms_norm_triton(x, w, 1e-5, residual=residual)
    want_out, want_residual = ref.rms_norm_ref(x, w, 1e-5, residual=residual)
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(rms_norm(x, w, 1e-5, residual=residual)[0], want_out, **TOL[dtype])


@pytest.mark.parametrize("heads,head_dim", [((4, 2), 32), ((3, 1), 64), ((5, 5), 24)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype, heads, head_dim):
    num_tokens = 11
    q = torch.randn(num_tokens, heads[0], head_dim, dtype=dtype)
    k = torch.randn(num_tokens, heads[1], head_dim, dtype=dtype)
    positions = torch.randint(0, 20000, (num_tokens,))
    cos, sin = rotary_cos_sin(inv_frequencies(head_dim, 500000.0, LLAMA3), positions, dtype)
    want = ref.apply_rotary_ref(q, k, cos, sin)
    for got in (rotary.apply_rotary_triton(q, k, cos, sin), apply_rotary(q, k, cos, sin)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL[dtype])


def test_rotary_non_contiguous_input():
    """q/k sliced out of a fused QKV projection (a strided view) rotate the same."""
    qkv = torch.randn(6, 4 + 2 + 2, 32)
    q, k = qkv[:, :4], qkv[:, 4:6]
    cos, sin = rotary_cos_sin(inv_frequencies(32), torch.arange(6), torch.float32)
    got = rotary.apply_rotary_triton(q, k, cos, sin)
    for g, w in zip(got, ref.apply_rotary_ref(q, k, cos, sin)):
        torch.testing.assert_close(g, w, **TOL[torch.float32])


def test_llama3_scaling_only_touches_low_frequencies():
    plain = inv_frequencies(128, 500000.0)
    scaled = inv_frequencies(128, 500000.0, LLAMA3)
    torch.testing.assert_close(scaled[:10], plain[:10])  # short wavelengths kept
    torch.testing.assert_close(scaled[-10:], plain[-10:] / 8.0)  # long ones divided by factor


@pytest.mark.parametrize("shape", [(3, 1000), (2, 4, 700), (1,)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype, shape):
    gate, up = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    want = ref.swiglu_ref(gate, up)
    torch.testing.assert_close(activation.swiglu_triton(gate, up), want, **TOL[dtype])
    torch.testing.assert_close(swiglu(gate, up), want, **TOL[dtype])


def test_dispatch_keeps_autograd_on_cpu():
    """Inference-only kernels are bypassed when gradients are needed; the torch path differentiates."""
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.ones(16)
    rms_norm(x, w).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    g = torch.randn(8, requires_grad=True)
    swiglu(g, torch.ones(8)).sum().backward()
    torch.testing.assert_close(g.grad, torch.sigmoid(g) * (1 + g * (1 - torch.sigmoid(g))), rtol=1e-5, atol=1e-6)
