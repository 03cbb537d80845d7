"""first_max against torch's max(-1): the first maximum of each row, on the C++ path and the
torch one; rows the C++ pass cannot answer (NaN, +inf, nothing but -inf) say so with a NaN."""

import math

import pytest
import torch

from baton.kernels import argmax
from baton.kernels.cpu_extension import cpu_kernels

from ..system import needs


@needs("c++")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 63, 1000, 8192])
def test_first_max_equals_torch_max_on_finite_rows(dtype, n):
    assert cpu_kernels() is not None  # the C++ path under test (serving loads it the same way)
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(12, n, generator=g) * 4).to(dtype)
    if n > 3:
        x[2, [n - 1, 2, n // 2]] = x[2].max() + 2  # a three-way tie: the first wins
        x[3, :] = 0.0
        x[3, 1] = -0.0  # -0.0 == 0.0: the first of them
        x[4, ::3] = -math.inf  # masked tokens are below any maximum
        x[5, :-1] = -math.inf  # only the last is finite
    x[6] = x[6] - 1e4  # all negative
    peak, index = argmax.first_max(x)
    want_peak, want_index = x.max(-1)
    assert index.tolist() == want_index.tolist()
    assert torch.equal(peak, want_peak.float())
    strided = x[:, : max(1, n // 2)]  # rows of a wider tensor
    assert argmax.first_max(strided)[1].tolist() == strided.max(-1)[1].tolist()


@needs("c++")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_with_nan_inf_or_only_minus_inf_has_no_finite_maximum(dtype):
    assert cpu_kernels() is not None
    x = torch.randn(5, 200).to(dtype)
    x[0, 70], x[1, 3], x[2] = math.nan, math.inf, -math.inf
    peak, index = argmax.first_max(x)
    assert [math.isfinite(v) for v in peak.tolist()] == [False, False, False, True, True]
    assert index[3:].tolist() == x[3:].max(-1)[1].tolist()


def test_without_the_cpu_kernels_it_is_torch_max(monkeypatch):
    monkeypatch.setattr(argmax, "loaded_cpu_kernels", lambda *t: None)
    x = torch.randn(4, 100)
    x[0, 5] = math.nan
    peak, index = argmax.first_max(x)
    want = x.max(-1)
    assert torch.equal(index, want.indices) and torch.allclose(peak, want.values, equal_nan=True)
