"""Paged decode (split-K + reduce, FlashDecoding++ unified max with its fallback) and the KV-cache
write: Triton kernels under the interpreter and the CPU dispatch path against the references. The
C++ kernel's tests need a C++ compiler (`CPP`: "c++" in tests/system.py)."""

from pathlib import Path

import pytest
import torch

from baton.kernels import kv_cache, paged_attention as pa, reference as ref
from baton.kernels.cpu_extension import cpu_kernels
from baton.kernels.kv_cache import reshape_and_cache
from baton.kernels.paged_attention import paged_attention_decode, plan_splits

from ..system import needs

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
# very different lengths in one batch, incl. an empty slot and lengths off the 16/32/64 tile grid
LENS = [0, 1, 17, 100, 250]
CPP = needs("c++")  # the tests of the C++ kernel (kernels/cpu_extension.py builds it)


def _decode_case(dtype, lens, heads=(8, 2), head_dim=32, block_size=16, spare_blocks=3):
    hq, hkv = heads
    max_blocks = max(1, -(-max(lens) // block_size)) + 1  # one more slot than needed: never read
    num_blocks = len(lens) * max_blocks + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks)[: len(lens) * max_blocks].reshape(len(lens), max_blocks).to(torch.int32)
    q = torch.randn(len(lens), hq, head_dim, dtype=dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode(dtype, heads, num_splits, window):
    args = _decode_case(dtype, LENS, heads)
    want = ref.paged_attention_decode_ref(*args, sliding_window=window)
    got = pa.paged_attention_decode_triton(*args, sliding_window=window, num_splits=num_splits)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(paged_attention_decode(*args, sliding_window=window), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_small_pages_scale_and_max_context_len(dtype):
    args = _decode_case(dtype, [3, 40, 9], heads=(6, 3), head_dim=64, block_size=8)
    want = ref.paged_attention_decode_ref(*args, softmax_scale=0.3)
    for kwargs in (dict(num_splits=4), dict(max_context_len=40)):
        got = pa.paged_attention_decode_triton(*args, softmax_scale=0.3, **kwargs)
        torch.testing.assert_close(got, want, **TOL[dtype])
    cpu = paged_attention_decode(*args, softmax_scale=0.3, max_context_len=40)
    torch.testing.assert_close(cpu, want, **TOL[dtype])


@CPP
def test_cpu_kernels_build_and_dispatch_uses_them():
    """CI machines have a C++ compiler (DeepSpeed's CPU Adam needs one too): the build must work,
    and the dispatcher must pick the C++ kernel for float32 and bfloat16 CPU tensors, the torch path otherwise."""
    assert cpu_kernels() is not None
    args = _decode_case(torch.float32, [5, 40])
    assert pa.cpu_kernel_fits(*args[:3])
    assert pa.cpu_kernel_fits(*(a.bfloat16() for a in args[:3]))
    assert not pa.cpu_kernel_fits(*(a.half() for a in args[:3]))
    assert not pa.cpu_kernel_fits(args[0].bfloat16(), *args[1:3])  # q and the pools must agree


def _cpu_flags() -> set[str]:
    line = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@CPP
@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU's flags from /proc/cpuinfo")
def test_cpu_kernel_compiles_the_widest_vector_path():
    """The build (-march=native) picks AVX-512 where the CPU has it, else AVX2+FMA, else the portable
    loops: the tests below then exercise the path this CPU compiled (AVX2 on the Zen 2 CI machine)."""
    flags = _cpu_flags()
    want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
    assert cpu_kernels().paged_decode_simd() == want


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=CPP), "torch"])
@pytest.mark.parametrize("window", [None, 50, 1])
@pytest.mark.parametrize(
    "heads,head_dim,block_size",
    [((4, 4), 32, 16), ((8, 2), 64, 8), ((16, 4), 64, 4), ((8, 1), 128, 16), ((6, 3), 48, 4)],
)
def test_decode_cpu_paths(impl, heads, head_dim, block_size, window):
    """The C++ kernel (for head_dim 32/64/128 its vector path, AVX-512's 16-token or AVX2's 8-token
    score chunks, which pages of 4 and 8 tokens and the window's start cut; the portable loops for
    48 and on CPUs with neither) and the torch bucketing path, on MHA/GQA/MQA with lengths from 0 to
    past 2 x 250, against the reference."""
    lens = LENS + [600, 3, 251, 499]
    q, k_cache, v_cache, tables, ctx = _decode_case(torch.float32, lens, heads, head_dim, block_size)
    q = torch.randn(q.shape[0], q.shape[2], q.shape[1]).transpose(1, 2)  # not contiguous
    want = ref.paged_attention_decode_ref(q, k_cache, v_cache, tables, ctx, sliding_window=window, softmax_scale=0.2)
    fn = pa.paged_attention_decode_cpu if impl == "cpu" else pa.paged_attention_decode_torch
    got = fn(q, k_cache, v_cache, tables, ctx, sliding_window=window, softmax_scale=0.2)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert (got[0] == 0).all()  # the empty slot attends to nothing


@CPP
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 64), ((8, 1), 128), ((4, 2), 32), ((6, 3), 48)])
def test_decode_cpu_kernel_bfloat16(heads, head_dim, window):
    """bfloat16 pools and queries (the vector path for 32, 64 and 128: its scores through vdpbf16ps
    where the CPU has AVX-512 BF16, else widened; the portable loops for 48): the C++ kernel computes
    in float32 and rounds once, so it is within one bfloat16 rounding of the float32 reference on
    the same (bfloat16) values."""
    q, k_cache, v_cache, tables, ctx = _decode_case(torch.bfloat16, LENS + [600, 3], heads, head_dim, 16)
    want = ref.paged_attention_decode_ref(
        q.float(), k_cache.float(), v_cache.float(), tables, ctx, sliding_window=window, softmax_scale=0.2
    )
    got = pa.paged_attention_decode_cpu(q, k_cache, v_cache, tables, ctx, sliding_window=window, softmax_scale=0.2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2**-8)
    assert (got[0] == 0).all()


@CPP
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_decode_cpu_tail_mask(heads):
    """Rows that see only some of their last T tokens (a speculative tree's nodes: the cached prefix
    and their ancestors), incl. rows shorter than T, against the reference's masked attention."""
    lens, tail_len = [5, 40, 17, 3, 64, 6], 6
    q, k_cache, v_cache, tables, ctx = _decode_case(torch.float32, lens, heads)
    tail = torch.rand(len(lens), tail_len, generator=torch.Generator().manual_seed(1)) < 0.5
    tail[:, -1] = True  # a node always sees itself
    got = pa.paged_attention_decode_cpu(q, k_cache, v_cache, tables, ctx, softmax_scale=0.3, tail_mask=tail)
    for b, n in enumerate(lens):
        keep = torch.ones(1, n, dtype=torch.bool)
        seen = min(tail_len, n)
        keep[0, n - seen :] = tail[b, tail_len - seen :]
        keys, vals = ref.gather_paged(k_cache, tables[b], n), ref.gather_paged(v_cache, tables[b], n)
        want = ref._attend(q[b : b + 1], keys, vals, keep, 0.3)[0]
        torch.testing.assert_close(got[b], want, **TOL[torch.float32])
    with pytest.raises(RuntimeError, match="sliding window"):
        pa.paged_attention_decode_cpu(q, k_cache, v_cache, tables, ctx, sliding_window=8, tail_mask=tail)


@CPP
def test_decode_cpu_kernel_refuses_bad_block_tables():
    """An entry outside the pool or a table too short for its length is an error, not a wild read."""
    q, k_cache, v_cache, tables, lens = _decode_case(torch.float32, [20, 40])
    bad = tables.clone()
    bad[1, 2] = k_cache.shape[0]  # the 3rd of the 3 blocks 40 tokens need
    with pytest.raises(RuntimeError, match="outside the pool"):
        pa.paged_attention_decode_cpu(q, k_cache, v_cache, bad, lens)
    bad[1, 2] = -1
    with pytest.raises(RuntimeError, match="outside the pool"):
        pa.paged_attention_decode_cpu(q, k_cache, v_cache, bad, lens)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        pa.paged_attention_decode_cpu(q, k_cache, v_cache, tables[:, :2], lens)
    bad[1, 2] = 0
    bad[0, 2:] = -1  # entries past a row's length are never read: padding may hold anything
    ok = pa.paged_attention_decode_cpu(q, k_cache, v_cache, bad, lens)
    torch.testing.assert_close(ok[0], ref.paged_attention_decode_ref(q, k_cache, v_cache, tables, lens)[0])


@CPP
@pytest.mark.parametrize("lens", [[2000] + [7] * 9, [2000, 7]])  # whole sequences / kv heads as work items
def test_decode_cpu_kernel_splits_work_across_threads(lens):
    """One very long row among short ones, on 1 and 2 threads: same result as the reference."""
    case = _decode_case(torch.float32, lens, heads=(8, 2))
    want = ref.paged_attention_decode_ref(*case)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.testing.assert_close(pa.paged_attention_decode_cpu(*case), want, **TOL[torch.float32])
    finally:
        torch.set_num_threads(threads)


# Unified max: scores here are ~N(0, 1); 3.0 is a sensible estimate, -300 overflows 2^(s - phi)
# (fallback), 300 underflows it to 0 (fallback), a per-head tensor mixes both.
ESTIMATES = {
    "good": 3.0,
    "too_low": -300.0,
    "too_high": 300.0,
    "per_head": torch.tensor([3.0, -300.0, 300.0, 0.0, 3.0, 3.0, 40.0, -40.0]),
}


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, in the interpreter,
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # before the fallback
@pytest.mark.parametrize("estimate", list(ESTIMATES))
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_unified_max(dtype, num_splits, estimate):
    args = _decode_case(dtype, LENS, heads=(8, 2))
    want = ref.paged_attention_decode_ref(*args)
    got = pa.paged_attention_decode_triton(*args, num_splits=num_splits, max_score_estimate=ESTIMATES[estimate])
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_decode_unified_max_with_large_scores_and_window():
    """Scores far above the estimate in one split only: that split falls back, the others do not."""
    q, k_cache, v_cache, tables, lens = _decode_case(torch.float32, [200, 130], heads=(2, 1))
    k_cache[tables[0, 0], 3] *= 40.0  # one huge-score key early in sequence 0
    want = ref.paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, sliding_window=190)
    got = pa.paged_attention_decode_triton(
        q, k_cache, v_cache, tables, lens, sliding_window=190, num_splits=4, max_score_estimate=2.0
    )
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_plan_splits_covers_every_key():
    for max_len in (1, 63, 64, 65, 1000, 100_000):
        for requested in (None, 1, 7, 1000):
            plan = plan_splits(2, 8, max_len, torch.float16, torch.device("cpu"), requested)
            assert plan.split_size % plan.block_n == 0
            assert plan.num_splits * plan.split_size >= max_len > (plan.num_splits - 1) * plan.split_size


def _cache_case(dtype, num_tokens=9, heads=3, head_dim=24, num_blocks=5, block_size=4):
    k = torch.randn(num_tokens, heads, head_dim, dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 5]] = -1  # padding tokens
    pools = [torch.full((num_blocks, block_size, heads, head_dim), float("nan"), dtype=dtype) for _ in range(2)]
    return k, v, *pools, slots


@pytest.mark.parametrize("impl", ["triton", "dispatch", pytest.param("cpu", marks=CPP)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache(dtype, impl):
    """Written slots hold the tokens, every other slot is still NaN (nothing else was touched);
    "cpu": the C++ row copy (what the dispatcher picks for float32/bfloat16 once the kernels are loaded)."""
    if (impl, dtype) in (("triton", torch.bfloat16), ("cpu", torch.float16)):
        pytest.skip("triton: fp32/fp16 under the interpreter; the C++ copy: fp32/bf16")
    k, v, k_cache, v_cache, slots = _cache_case(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.reshape_and_cache_ref(k, v, want_k, want_v, slots)
    fn = {"triton": kv_cache.reshape_and_cache_triton, "dispatch": reshape_and_cache}.get(impl)
    if fn is None:
        fn = cpu_kernels().cache_write
    fn(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, want_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, want_v, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(k_cache).sum() == k_cache.numel() - 7 * 3 * 24


def test_write_then_decode_end_to_end():
    """Tokens written with reshape_and_cache are what decode attends to."""
    q, k_cache, v_cache, tables, lens = _decode_case(torch.float32, [5, 21], heads=(4, 2), block_size=8)
    new_k, new_v = torch.randn(2, 2, 2, 32)
    positions = lens.long()  # each sequence appends its next token
    slots = tables.long()[torch.arange(2), positions // 8] * 8 + positions % 8
    kv_cache.reshape_and_cache_triton(new_k, new_v, k_cache, v_cache, slots)
    got = pa.paged_attention_decode_triton(q, k_cache, v_cache, tables, lens + 1, num_splits=2)
    torch.testing.assert_close(
        got, ref.paged_attention_decode_ref(q, k_cache, v_cache, tables, lens + 1), **TOL[torch.float32]
    )


def test_length_buckets_cover_every_row_once_within_the_waste_bound():
    lens = [0, 1, 17, 100, 250, 251, 30, 16, 900, 5]
    groups = pa.length_buckets(lens, max_waste=2.0)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert lens[g[0]] == max(lens[i] for i in g)  # the first row sizes the group's padding
        assert all(lens[i] * 2.0 >= lens[g[0]] for i in g)
    assert len(pa.length_buckets([7] * 5)) == 1
