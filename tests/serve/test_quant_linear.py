"""Quantized linear modules against dequantize-then-matmul references, and RTN weights against the
formats' definitions (written out here independently of baton.kernels.quant)."""

import pytest
import torch
from torch import nn

from baton.kernels.reference import unpack_int4
from baton.kernels.quant import pack_int4
from baton.serve.quantization.linear import FORMATS
from baton.serve.quantization.rtn import fake_quantize, rtn_linear


def _linear(k, n, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.5)
        lin.weight[:, 3] *= 8  # an outlier input channel
    return lin


def _round(x):
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def int8_definition(w):
    s = w.abs().amax(1) / 127
    return _round(w / s[:, None]).clamp(-127, 127) * s[:, None]


def int4_definition(w, g):
    """Asymmetric min/max per group of g input channels, the last group zero-padded."""
    n, k = w.shape
    wp = torch.cat([w, w.new_zeros(n, -k % g)], 1).reshape(n, -1, g)
    lo, hi = wp.amin(-1, keepdim=True), wp.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    z = _round(-lo / s).clamp(0, 15)
    return ((_round(wp / s) + z).clamp(0, 15) - z).mul(s).reshape(n, -1)[:, :k]


@pytest.mark.parametrize("k,g", [(128, 32), (128, 128), (96, 64), (100, 32)])  # 96, 100: padded last group
def test_int4_rtn_matches_definition_and_reference_matmul(k, g):
    lin = _linear(k, 24)
    q = rtn_linear(lin, "int4", g)
    want_w = int4_definition(lin.weight.detach().double(), g)
    torch.testing.assert_close(q.dequantize().double(), want_w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fake_quantize(lin.weight.detach(), 4, g).double(), want_w, rtol=1e-6, atol=1e-6)
    x = torch.randn(5, 7, k)
    torch.testing.assert_close(q(x), x @ q.dequantize().T + lin.bias.detach(), rtol=1e-5, atol=1e-5)
    assert q.qweight.dtype == torch.uint8 and q.qweight.numel() * 2 == 24 * (-(-k // g) * g)  # two per byte


def test_int8_and_w8a16_matmul():
    lin = _linear(80, 40)
    q = rtn_linear(lin, "int8")
    torch.testing.assert_close(
        q.dequantize().double(), int8_definition(lin.weight.detach().double()), rtol=1e-6, atol=1e-7
    )
    x = torch.randn(3, 80)
    torch.testing.assert_close(q(x), x @ q.dequantize().T + lin.bias.detach(), rtol=1e-5, atol=1e-5)


def test_w8a8_matches_per_token_reference():
    lin = _linear(64, 48)
    q = rtn_linear(lin, "w8a8")
    x = torch.randn(2, 9, 64).double()
    xs = x.abs().amax(-1, keepdim=True) / 127
    xq = _round(x / xs).clamp(-127, 127) * xs  # per-token int8, dequantized
    want = xq @ q.dequantize().double().T + lin.bias.detach().double()
    torch.testing.assert_close(q(x.float()).double(), want, rtol=1e-4, atol=1e-4)


def test_fp8_round_trip():
    lin = _linear(64, 32)
    q = rtn_linear(lin, "fp8")
    w = lin.weight.detach()
    assert q.qweight.dtype == torch.float8_e4m3fn
    # Each row's max maps to 448 exactly; every weight is within e4m3's half-ulp (2^-4 relative, normals).
    torch.testing.assert_close(q.dequantize().abs().amax(1), w.abs().amax(1), rtol=1e-6, atol=0)
    normal = w.abs() / (w.abs().amax(1, keepdim=True) / 448) >= 2**-6  # e4m3's smallest normal
    assert ((q.dequantize() - w).abs() <= w.abs() * 2**-4 + 1e-12)[normal].all()
    x = torch.randn(4, 64)
    torch.testing.assert_close(q(x), x @ q.dequantize().T + lin.bias.detach(), rtol=1e-5, atol=1e-5)


def test_packed_int4_round_trips():
    levels = torch.randint(0, 16, (6, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(levels)), levels)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_bf16_compute_dtype_stays_close(fmt):
    """The CPU fast path (bf16 activations into the int8/int4 kernels) within bf16 precision."""
    lin = _linear(128, 64, bias=False)
    q = rtn_linear(lin, fmt, 32)
    x = torch.randn(3, 128)
    exact = q(x)
    q.compute_dtype = torch.bfloat16
    fast = q(x)
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())
