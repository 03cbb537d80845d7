"""The chunked SSD scan (Triton under the interpreter, and the torch path) against the token-by-token
recurrence in kernels/reference.py, in fp32: any chunk size, carried state, groups, ragged shapes."""

import pytest
import torch

from baton.kernels import reference as ref
from baton.kernels.ssd_scan import ssd_scan, ssd_scan_torch, ssd_scan_triton

TOL = dict(atol=2e-5, rtol=2e-5)


def inputs(b=2, length=37, heads=4, p=8, groups=2, n=16, with_state=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, length, heads, p, generator=g)
    dt = torch.rand(b, length, heads, generator=g) * 0.5
    A = -torch.rand(heads, generator=g) * 2 - 0.1
    B = torch.randn(b, length, groups, n, generator=g)
    C = torch.randn(b, length, groups, n, generator=g)
    s0 = torch.randn(b, heads, p, n, generator=g) if with_state else None
    return x, dt, A, B, C, s0


@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_torch_chunked_scan_equals_recurrence_for_any_chunk_size(chunk, with_state):
    x, dt, A, B, C, s0 = inputs(with_state=with_state)
    want_y, want_s = ref.ssd_scan_ref(x, dt, A, B, C, s0)
    y, s = ssd_scan_torch(x, dt, A, B, C, chunk, s0)
    torch.testing.assert_close(y, want_y, **TOL)
    torch.testing.assert_close(s, want_s, **TOL)
    assert want_y.abs().max() > 1 and want_s.abs().max() > 1  # not a comparison of near-zeros


@pytest.mark.parametrize(
    "shape",
    [
        dict(),  # 37 tokens: one partial chunk of the kernel's 64
        dict(length=150, heads=3, groups=1, p=12, n=24),  # three chunks, non-power-of-two head_dim/d_state
        dict(length=5, heads=2, groups=2, p=16, n=16, b=1),
    ],
)
@pytest.mark.parametrize("with_state", [False, True])
def test_triton_scan_equals_recurrence(shape, with_state):
    x, dt, A, B, C, s0 = inputs(**shape, with_state=with_state)
    want_y, want_s = ref.ssd_scan_ref(x, dt, A, B, C, s0)
    y, s = ssd_scan_triton(x, dt, A, B, C, s0)
    torch.testing.assert_close(y, want_y, **TOL)
    torch.testing.assert_close(s, want_s, **TOL)


@pytest.mark.parametrize("scan", ["triton", "torch"])
def test_state_carried_across_two_calls_equals_one_pass(scan):
    x, dt, A, B, C, _ = inputs(length=45, with_state=False)
    run = (lambda *a: ssd_scan_triton(*a)) if scan == "triton" else (lambda *a: ssd_scan_torch(*a[:5], 8, a[5]))
    whole_y, whole_s = run(x, dt, A, B, C, None)
    k = 19
    y1, s1 = run(x[:, :k], dt[:, :k], A, B[:, :k], C[:, :k], None)
    y2, s2 = run(x[:, k:], dt[:, k:], A, B[:, k:], C[:, k:], s1)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), whole_y, **TOL)
    torch.testing.assert_close(s2, whole_s, **TOL)


def test_triton_reads_strided_views():
    """x, B and C are slices of one conv output in the mixer: non-contiguous views."""
    b, length, heads, p, n = 2, 20, 4, 8, 16
    packed = torch.randn(b, length, heads * p + 2 * n)
    x = packed[..., : heads * p].view(b, length, heads, p)
    B = packed[..., heads * p : heads * p + n].unsqueeze(2)
    C = packed[..., heads * p + n :].unsqueeze(2)
    dt = torch.rand(b, heads, length).transpose(1, 2)  # strided in l and h
    A = -torch.rand(heads)
    want = ref.ssd_scan_ref(x, dt, A, B, C)
    for got, expected in zip(ssd_scan_triton(x, dt, A, B, C), want):
        torch.testing.assert_close(got, expected, **TOL)


def test_dispatcher_gradients_match_the_recurrence():
    """Off CUDA (and whenever autograd records) ssd_scan is the differentiable torch path."""
    leaves = [t.requires_grad_() for t in inputs(length=21) if t is not None]
    y, s = ssd_scan(*leaves[:5], 8, leaves[5])
    grads = torch.autograd.grad((y.square().sum() + s.sum()), leaves)
    want_y, want_s = ref.ssd_scan_ref(*leaves)
    want = torch.autograd.grad((want_y.square().sum() + want_s.sum()), leaves)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_dispatcher_routes_to_triton_only_without_autograd(monkeypatch):
    """The CUDA branch, forced on CPU tensors: Triton for inference, torch when gradients are needed."""
    from baton.kernels import ssd_scan as mod

    ran = []
    monkeypatch.setattr(mod, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(mod, "ssd_scan_triton", lambda *a: ran.append("triton") or ssd_scan_triton(*a))
    x, dt, A, B, C, s0 = inputs(length=12)
    want = ref.ssd_scan_ref(x, dt, A, B, C, s0)
    for got, expected in zip(mod.ssd_scan(x, dt, A, B, C, 8, s0), want):
        torch.testing.assert_close(got, expected, **TOL)
    assert ran == ["triton"]
    y, _ = mod.ssd_scan(x.requires_grad_(), dt, A, B, C, 8, s0)
    assert ran == ["triton"] and y.requires_grad


@pytest.mark.parametrize("scan", ["triton", "torch"])
def test_exact_when_a_fast_decay_precedes_a_slow_one(scan):
    """40 steps of strong decay make the chunk's cumulative log decay about -10^4; the slow steps
    after it still decay by e^-0.06 each. Differences of that cumsum (cs_l - cs_s) lose ~1e-3 of
    those decays in fp32 (0.15 absolute on outputs of ~90); summing the steps directly does not."""
    x, _, _, B, C, _ = inputs(b=1, length=64, heads=2, groups=1, p=16, with_state=False)
    dt = torch.full((1, 64, 2), 1e-3)
    dt[:, :40] = 4.0
    A = torch.tensor([-60.0, -30.0])
    want_y, want_s = ref.ssd_scan_ref(x, dt, A, B, C)
    y, s = ssd_scan_triton(x, dt, A, B, C) if scan == "triton" else ssd_scan_torch(x, dt, A, B, C, 64)
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-5)
