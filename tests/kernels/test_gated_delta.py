"""The gated delta rule (kernels/gated_delta.py): its float64 token-by-token reference against
transformers' two torch implementations, then every path against that reference - the chunked torch
form at any chunk length, the float32 token loop, the Triton kernels under the interpreter, the decode
step over a pool of states - with odd lengths, one token, carried state, grouped heads, strided inputs,
gradients, half precision and a fast decay before a slow one."""

import pytest
import torch
from baton.kernels import gated_delta as gd

TOL = 1e-5  # fp32 paths: max |error| / max |reference|


def inputs(b=2, length=37, hk=2, hv=4, dk=16, dv=24, with_state=True, seed=0):
    """Random q/k (normalised by the flag), g in [-0.7, 0] and beta in [0, 1] as the model makes them
    (g = -A softplus(.), beta = sigmoid(.)), and a state of unit scale."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, length, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, length, hv, dv, generator=gen)
    g = -0.7 * torch.rand(b, length, hv, generator=gen)
    beta = torch.rand(b, length, hv, generator=gen)
    s0 = torch.randn(b, hv, dk, dv, generator=gen) if with_state else None
    return q, k, v, g, beta, s0


def reference(q, k, v, g, beta, s0=None, l2=True):
    return gd.gated_delta_rule_ref(q, k, v, g, beta, s0, use_qk_l2norm_in_kernel=l2)


def assert_rel(got, want, tol=TOL):
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"
    assert want.abs().max() > 0.1  # not a comparison of near-zeros


PATHS = {
    "torch_c16": lambda *a, **kw: gd.gated_delta_rule_torch(*a, chunk_size=16, **kw),
    "torch_c64": gd.gated_delta_rule_torch,
    "recurrent": gd.gated_delta_rule_recurrent,
    "triton": gd.gated_delta_rule_triton,
}


@pytest.mark.parametrize("with_state", [False, True])
def test_reference_equals_transformers(with_state):
    """transformers' recurrent and chunked functions (float32) against ours (float64): the same
    recurrence, head grouping (repeat_interleave), L2 norm and Dk**-0.5 scale."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, s0 = inputs(length=70, with_state=with_state)  # two of HF's 64-token chunks
    want_o, want_s = reference(q, k, v, g, beta, s0)
    for hf in (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule):
        o, s = hf(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_rel(o, want_o)
        assert_rel(s, want_s)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "shape",
    [
        dict(),  # 37 tokens: a partial chunk; 2 value heads per key head; Dk != Dv
        dict(length=1),
        dict(b=1, length=150, hk=1, hv=2, dk=24, dv=40),  # three Triton chunks, non-power-of-two dims
    ],
    ids=["T37", "T1", "T150"],
)
@pytest.mark.parametrize("with_state", [False, True])
def test_paths_equal_the_reference(path, shape, with_state):
    q, k, v, g, beta, s0 = inputs(**shape, with_state=with_state)
    want_o, want_s = reference(q, k, v, g, beta, s0)
    o, s = PATHS[path](q, k, v, g, beta, s0, use_qk_l2norm_in_kernel=True)
    assert o.dtype == q.dtype and s.dtype == torch.float32
    assert_rel(o, want_o)
    assert_rel(s, want_s)


@pytest.mark.parametrize("chunk", [1, 5, 32, 128])
def test_chunked_form_does_not_depend_on_the_chunk_length(chunk):
    q, k, v, g, beta, s0 = inputs(length=45)
    o, s = gd.gated_delta_rule_torch(q, k, v, g, beta, s0, chunk_size=chunk, use_qk_l2norm_in_kernel=True)
    want_o, want_s = reference(q, k, v, g, beta, s0)
    assert_rel(o, want_o)
    assert_rel(s, want_s)


@pytest.mark.parametrize("path", ["torch_c16", "triton"])
def test_without_the_norm_flag_q_and_k_are_used_as_given(path):
    q, k, v, g, beta, s0 = inputs(length=20)
    q, k = gd.l2norm(q) * 1.5, gd.l2norm(k)  # the caller normalised k; q's scale is its own
    o, s = PATHS[path](q, k, v, g, beta, s0, scale=0.3)
    want_o, want_s = gd.gated_delta_rule_ref(q, k, v, g, beta, s0, scale=0.3)
    assert_rel(o, want_o)
    assert_rel(s, want_s)
    assert PATHS[path](q, k, v, g, beta, s0, output_final_state=False)[1] is None


@pytest.mark.parametrize("path", ["torch_c16", "recurrent", "triton"])
def test_state_carried_across_two_calls_equals_one_pass(path):
    q, k, v, g, beta, s0 = inputs(b=1, length=83, hk=1, hv=2)
    run = PATHS[path]
    whole_o, whole_s = run(q, k, v, g, beta, s0, use_qk_l2norm_in_kernel=True)
    cut = 67  # past a full Triton chunk, inside a chunk of 16
    o1, s1 = run(*(t[:, :cut] for t in (q, k, v, g, beta)), s0, use_qk_l2norm_in_kernel=True)
    o2, s2 = run(*(t[:, cut:] for t in (q, k, v, g, beta)), s1, use_qk_l2norm_in_kernel=True)
    assert_rel(torch.cat([o1, o2], dim=1), whole_o)
    assert_rel(s2, whole_s)


@pytest.mark.parametrize("path", ["torch_c16", "recurrent", "triton"])
@pytest.mark.parametrize("l2", [True, False])
def test_strided_views(path, l2):
    """In the mixer q, k and v are slices of one conv output, g and beta computed per head: views."""
    b, length, hk, hv, dk, dv = 2, 20, 2, 4, 16, 8
    packed = torch.randn(b, length, 2 * hk * dk + hv * dv)
    q = packed[..., : hk * dk].view(b, length, hk, dk)
    k = packed[..., hk * dk : 2 * hk * dk].view(b, length, hk, dk)
    v = packed[..., 2 * hk * dk :].view(b, length, hv, dv)
    g = -torch.rand(b, hv, length).transpose(1, 2)
    beta = torch.rand(b, 2 * hv, length)[:, ::2].transpose(1, 2)
    if not l2:  # the caller normalised k (in place: k stays a view)
        k.copy_(gd.l2norm(k))
    s0 = torch.randn(b, hv, dk, dv)
    want = reference(q, k, v, g, beta, s0, l2=l2)
    for got, expected in zip(PATHS[path](q, k, v, g, beta, s0, use_qk_l2norm_in_kernel=l2), want):
        assert_rel(got, expected)
    step = (t[:, 0] for t in (q, k, v, g, beta))  # and one decode step from the same views
    pool, slots = torch.zeros(3, hv, dk, dv), torch.tensor([2, 0])
    pool[slots] = s0
    o = (gd.gated_delta_decode_triton if path == "triton" else gd.gated_delta_decode_torch)(
        *step, pool, slots, use_qk_l2norm_in_kernel=l2
    )
    assert_rel(o, want[0][:, 0])


def test_chunked_gradients_match_the_reference():
    """The chunked torch form is the training path: its gradients, through every input and the
    initial state, against autograd of the float64 recurrence."""
    leaves = [t.requires_grad_() for t in inputs(b=1, length=21, hv=2, hk=1, dk=8, dv=8)]
    o, s = gd.gated_delta_rule_torch(*leaves, chunk_size=8, use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad(o.square().sum() + s.sum(), leaves)
    want_o, want_s = reference(*leaves)
    want = torch.autograd.grad(want_o.square().sum() + want_s.sum(), leaves)
    for got, expected in zip(grads, want):
        assert_rel(got, expected, 1e-4)


@pytest.mark.parametrize("decode", [gd.gated_delta_decode_torch, gd.gated_delta_decode_triton])
def test_decode_step_over_a_slot_pool_equals_the_reference(decode):
    """Three sequences, each with its own prior state, in slots 4, 0 and 2 of a pool of 6, stepped four
    times: outputs and states as the reference run over their tokens; the other slots untouched."""
    q, k, v, g, beta, s0 = inputs(b=3, length=4)
    pool = torch.randn(6, *s0.shape[1:])
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    pool[slots.long()] = s0
    before = pool.clone()
    want_o, want_s = reference(q, k, v, g, beta, s0)
    for t in range(4):
        o = decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pool, slots, use_qk_l2norm_in_kernel=True)
        assert_rel(o, want_o[:, t])
    assert_rel(pool[slots.long()], want_s)
    assert torch.equal(pool[[1, 3, 5]], before[[1, 3, 5]])


@pytest.mark.parametrize("path", ["torch_c16", "triton", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(path, dtype):
    if path == "triton" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter computes bf16 wrongly; benchmarks/gated_delta_gpu.py checks it on a GPU")
    q, k, v, g, beta = (t.to(dtype) for t in inputs(b=1, length=40, with_state=False)[:5])
    want_o, want_s = reference(q, k, v, g, beta)
    o, s = PATHS[path](q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_rel(o, want_o, 2e-2)
    assert_rel(s, want_s, 2e-2)


@pytest.mark.parametrize("path", ["torch_c64", "triton"])
def test_exact_when_a_fast_decay_precedes_a_slow_one(path):
    """40 steps of g = -250 make a chunk's cumulative log decay -10^4; the slow steps after it decay by
    e^-0.01 each. Decays taken as differences of that cumsum lose ~1e-3 of their value in fp32; summed
    directly they do not."""
    q, k, v, g, beta, s0 = inputs(b=1, length=64, hk=1, hv=2, with_state=False)
    g = torch.full_like(g, -0.01)
    g[:, :40] = -250.0
    want_o, want_s = reference(q, k, v, g, beta)
    o, s = PATHS[path](q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert_rel(o, want_o)
    assert_rel(s, want_s)


@pytest.mark.parametrize("path", ["torch_c64", "triton"])
def test_repeated_keys(path):
    """A repeated token repeats its key: with k_i . k_j = 1, beta = 1 and no decay the chunk's
    triangular system has entries C(63, 31) ~ 1e18 in the powers of A, so a Neumann-series inverse
    cancels to garbage; substitution (the inverse is bidiagonal here) stays exact."""
    q, _, v, _, _, _ = inputs(b=1, length=64, hk=1, hv=1, with_state=False)
    k = torch.randn(1, 1, 1, 16).expand(1, 64, 1, 16)
    g, beta = torch.zeros(1, 64, 1), torch.ones(1, 64, 1)
    want_o, want_s = reference(q, k, v, g, beta)
    o, s = PATHS[path](q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert_rel(o, want_o)
    assert_rel(s, want_s)


def test_dispatch(monkeypatch):
    """CPU: the token loop up to CPU_RECURRENT_MAX_LEN tokens, the chunked form above it and whenever
    autograd records. CUDA (forced on CPU tensors): Triton, except with autograd."""
    ran = []
    for name in ("gated_delta_rule_triton", "gated_delta_rule_recurrent", "gated_delta_rule_torch"):
        real = getattr(gd, name)
        monkeypatch.setattr(gd, name, lambda *a, _real=real, _name=name, **kw: ran.append(_name) or _real(*a, **kw))
    short = inputs(length=gd.CPU_RECURRENT_MAX_LEN)
    long = inputs(length=gd.CPU_RECURRENT_MAX_LEN + 1)
    for x in (short, long):
        for got, want in zip(gd.gated_delta_rule(*x, use_qk_l2norm_in_kernel=True), reference(*x)):
            assert_rel(got, want)
    gd.gated_delta_rule(short[0].clone().requires_grad_(), *short[1:])
    assert ran == ["gated_delta_rule_recurrent", "gated_delta_rule_torch", "gated_delta_rule_torch"]
    ran.clear()
    monkeypatch.setattr(gd, "use_triton", lambda *tensors: True)
    gd.gated_delta_rule(*long)
    o, _ = gd.gated_delta_rule(long[0].clone().requires_grad_(), *long[1:])
    assert ran == ["gated_delta_rule_triton", "gated_delta_rule_torch"] and o.requires_grad


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(k=torch.zeros(2, 37, 2, 8)), "q and k must both be"),
        (dict(v=torch.zeros(2, 36, 4, 24)), "v must be"),
        (dict(v=torch.zeros(2, 37, 3, 24)), "must be a multiple of query/key heads"),
        (dict(g=torch.zeros(2, 37, 2)), "g must be"),
        (dict(beta=torch.zeros(2, 37)), "beta must be"),
        (dict(initial_state=torch.zeros(2, 4, 24, 16)), "state must be"),
    ],
)
def test_bad_shapes_are_named(change, message):
    q, k, v, g, beta, s0 = inputs()
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0) | change
    with pytest.raises(ValueError, match=message):
        gd.gated_delta_rule(**args)


def test_bad_pool_or_slots_are_named():
    q, k, v, g, beta, s0 = inputs(b=2, length=1)
    step = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    with pytest.raises(ValueError, match="slots must be 2"):
        gd.decode_step(*step, torch.zeros(3, *s0.shape[1:]), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="state_pool must be a contiguous"):
        gd.decode_step(*step, torch.zeros(3, 4, 24, 16).transpose(2, 3), torch.tensor([0, 1]))
