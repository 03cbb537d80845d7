"""Quantised matmuls (W8A16, W4A16, fp8 weight-only, W8A8) and per-token activation quantisation:
Triton kernels under the interpreter and the CPU dispatch paths against the references."""

import pytest
import torch

from baton.kernels import quant, quant_matmul as qm, reference as ref, w8a8
from baton.kernels import fp8_weight_matmul, int4_weight_matmul, int8_weight_matmul, quantize_per_token, w8a8_matmul

DTYPES = [torch.float32, torch.float16]
# (M, K, N): decode-sized M, prefill-sized M, and sizes off the 16/64-wide tile grid
SHAPES = [(1, 128, 64), (5, 200, 70), (37, 384, 100)]


def _close(got, want, dtype):
    """Relative to the output's scale: a K-long fp16 dot product is only as exact as its magnitude."""
    scale = want.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("mkn", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_weight_matmul(dtype, mkn):
    m, k, n = mkn
    x = torch.randn(m, k, dtype=dtype)
    w_int8, scales = quant.quantize_int8_per_channel(torch.randn(n, k))
    want = ref.int8_weight_matmul_ref(x, w_int8, scales)
    _close(qm.int8_weight_matmul_triton(x, w_int8, scales), want, dtype)
    _close(int8_weight_matmul(x, w_int8, scales), want, dtype)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("mkn", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_weight_matmul(dtype, mkn, group_size):
    m, k, n = mkn
    k = -(-k // group_size) * group_size  # the format needs whole groups
    x = torch.randn(m, k, dtype=dtype)
    packed, scales, zeros = quant.quantize_int4_groupwise(torch.randn(n, k), group_size)
    want = ref.int4_weight_matmul_ref(x, packed, scales, zeros, group_size)
    _close(qm.int4_weight_matmul_triton(x, packed, scales, zeros, group_size), want, dtype)
    _close(int4_weight_matmul(x, packed, scales, zeros, group_size), want, dtype)


@pytest.mark.parametrize("mkn", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_weight_matmul(dtype, mkn):
    m, k, n = mkn
    x = torch.randn(m, k, dtype=dtype)
    w_fp8, scales = quant.quantize_fp8_per_channel(torch.randn(n, k) * 3)
    want = ref.fp8_weight_matmul_ref(x, w_fp8, scales)
    _close(qm.fp8_weight_matmul_triton(x, w_fp8, scales), want, dtype)
    _close(fp8_weight_matmul(x, w_fp8, scales), want, dtype)


def test_fp8_bit_decode_covers_every_code():
    """All 254 finite e4m3 codes (subnormals included) decode exactly in the kernel's bit trick."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # drop the two NaN codes
    w_fp8 = codes.view(torch.float8_e4m3fn).reshape(2, 127)
    x = torch.eye(127)  # out[i, n] = w[n, i]
    got = qm.fp8_weight_matmul_triton(x, w_fp8, torch.ones(2))
    torch.testing.assert_close(got, w_fp8.float().T, rtol=0, atol=0)


def test_weight_only_leading_dims():
    x = torch.randn(2, 3, 64)
    w_int8, scales = quant.quantize_int8_per_channel(torch.randn(20, 64))
    got = qm.int8_weight_matmul_triton(x, w_int8, scales)
    assert got.shape == (2, 3, 20)
    _close(got, ref.int8_weight_matmul_ref(x.reshape(6, 64), w_int8, scales).reshape(2, 3, 20), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_per_token(dtype):
    x = torch.randn(9, 300, dtype=dtype) * torch.logspace(-2, 2, 9)[:, None].to(dtype)
    x[3] = 0  # an all-zero row quantises to zeros, not NaN
    q, scales = w8a8.quantize_per_token_triton(x)
    want_q, want_scales = w8a8.quantize_per_token_torch(x)
    torch.testing.assert_close(scales, want_scales, rtol=0, atol=0)
    torch.testing.assert_close(q, want_q, rtol=0, atol=0)
    assert (q[3] == 0).all()
    assert ((q.float() * scales[:, None] - x.float()).abs() <= scales[:, None] / 2 + 1e-6).all()
    assert quantize_per_token(x)[0].equal(want_q)


@pytest.mark.parametrize("mkn", SHAPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_w8a8_matmul(out_dtype, mkn):
    m, k, n = mkn
    act_absmax = torch.rand(k) * 10
    w = torch.randn(n, k)
    smooth = quant.smoothquant_scales(act_absmax, w)
    x = torch.randn(m, k) * act_absmax / smooth  # already divided by the smoothing scales
    w_int8, w_scales = quant.quantize_int8_per_channel(w * smooth)
    x_int8, x_scales = quantize_per_token(x)
    want = ref.w8a8_matmul_ref(x_int8, x_scales, w_int8, w_scales, out_dtype)
    _close(w8a8.w8a8_matmul_triton(x_int8, x_scales, w_int8, w_scales, out_dtype), want, out_dtype)
    _close(w8a8_matmul(x_int8, x_scales, w_int8, w_scales, out_dtype), want, out_dtype)


def test_cpu_paths_are_differentiable_in_x():
    """Training through a quantised layer on CPU: torch._weight_int8pack_mm has no derivative."""
    w_int8, scales = quant.quantize_int8_per_channel(torch.randn(6, 32))
    x = torch.randn(3, 32, requires_grad=True)
    int8_weight_matmul(x, w_int8, scales).sum().backward()
    torch.testing.assert_close(x.grad, (w_int8.float() * scales[:, None]).sum(0).expand(3, 32))
