"""Paged MLA decode over the latent-only cache, and its cache write: the C++ CPU kernel, the Triton kernels
under the interpreter and the torch path against the float64 reference; and the absorbed form against
the naive one (each head's K/V decompressed by a random kv_b_proj, plain softmax attention), which is
what shows that the kernel interface computes multi-head latent attention. The C++ kernel's tests need
a C++ compiler (`CPP`)."""

from pathlib import Path

import pytest
import torch
from baton.kernels import mla_decode as md
from baton.kernels import reference as ref
from baton.kernels.cpu_extension import cpu_kernels

from ..system import needs

CPP = needs("c++")
F32 = dict(atol=1e-5, rtol=1e-5)
LOOSE = {torch.bfloat16: dict(atol=4e-3, rtol=2**-7), torch.float16: dict(atol=2e-3, rtol=2e-3)}
# ragged: an empty padding slot, a single token, lengths off the 16/32-token tile and chunk grid
LENS = [0, 1, 17, 100, 250]
IMPLS = {"cpu": md.paged_mla_decode_cpu, "torch": md.paged_mla_decode_torch, "triton": md.paged_mla_decode_triton}


def _case(dtype, lens, heads=4, lora=36, rope=8, block_size=16):
    """q [T, H, L + R] and a latent pool whose blocks are scattered; each block table is padded with -1
    past the row's blocks (never read) and one spare column."""
    width = lora + rope
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    cache = torch.randn(num_blocks, block_size, width).to(dtype)
    tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    ids = torch.randperm(num_blocks).to(torch.int32).tolist()
    for r, k in enumerate(need):
        tables[r, :k] = torch.tensor(ids[:k], dtype=torch.int32)
        ids = ids[k:]
    q = torch.randn(len(lens), heads, width).to(dtype)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32)


def _want(q, cache, tables, lens, scale, lora):
    """The float64 reference on the same (possibly rounded) values."""
    return ref.paged_mla_decode_ref(q.double(), cache.double(), tables, lens, scale, lora)


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=CPP), "torch", "triton", "ref"])
def test_absorbed_decode_equals_naive_mla(impl):
    """DeepSeek's attention written out per head - K = cat(W_UK c, k_pe), V = W_UV c from a random
    kv_b_proj, q = cat(q_nope, q_pe), softmax(scale q.K) V - equals the absorbed form: the latents and
    rope keys written into the pool by mla_cache_write, q_lat = q_nope W_UK, the kernel over the pool,
    then W_UV applied to its output. float32, 1e-5; odd dims (nope 16, rope 8, v 12, L 36)."""
    heads, nope, rope, v_dim, lora, block_size, lens = 4, 16, 8, 12, 36, 16, [1, 17, 100]
    scale = (nope + rope) ** -0.5
    kv_b_proj = torch.randn(heads * (nope + v_dim), lora) * lora**-0.5  # HF's kv_b_proj.weight
    w_uk, w_uv = kv_b_proj.view(heads, nope + v_dim, lora).split([nope, v_dim], dim=1)
    q_nope, q_pe = torch.randn(len(lens), heads, nope), torch.randn(len(lens), heads, rope)
    latents = [torch.randn(n, lora) for n in lens]
    k_pes = [torch.randn(n, rope) for n in lens]

    naive = []
    for t, n in enumerate(lens):
        c, k_pe = latents[t].double(), k_pes[t].double()
        k = torch.cat([torch.einsum("hdl,sl->shd", w_uk.double(), c), k_pe[:, None].expand(n, heads, rope)], -1)
        v = torch.einsum("hdl,sl->shd", w_uv.double(), c)
        qt = torch.cat([q_nope[t], q_pe[t]], -1).double()  # [H, nope + rope]
        p = torch.softmax(torch.einsum("hd,shd->hs", qt, k) * scale, dim=-1)
        naive.append(torch.einsum("hs,shd->hd", p, v))
    naive = torch.stack(naive)

    _, cache, tables, ctx = _case(torch.float32, lens, heads, lora, rope, block_size)
    cache.fill_(float("nan"))  # every slot a row reads is written below
    for t, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[t, pos // block_size].long() * block_size + pos % block_size
        md.mla_cache_write(latents[t], k_pes[t], cache, slots)
    q = torch.cat([torch.einsum("thd,hdl->thl", q_nope, w_uk), q_pe], -1)
    fn = ref.paged_mla_decode_ref if impl == "ref" else IMPLS[impl]
    o_lat = fn(q, cache, tables, ctx, scale, lora)
    absorbed = torch.einsum("thl,hdl->thd", o_lat, w_uv)
    torch.testing.assert_close(absorbed.double(), naive, **F32)


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=CPP), "torch"])
@pytest.mark.parametrize(
    "heads,lora,rope,block_size",
    [(4, 36, 8, 16), (20, 40, 8, 3), (3, 64, 16, 5), (16, 512, 64, 16), (6, 16, 0, 8)],
)
def test_decode_cpu_paths_float32(impl, heads, lora, rope, block_size):
    """The C++ kernel (its register tiles' whole vectors and tails: L 36/40/64/512, L + R 44..576, head
    counts off the 4-head tile) and the torch path, over ragged rows on pages of 3 to 16 tokens."""
    case = _case(torch.float32, LENS + [41, 3], heads, lora, rope, block_size)
    want = _want(*case, 0.15, lora)
    got = IMPLS[impl](*case, 0.15, lora)
    assert got.shape == (len(LENS) + 2, heads, lora) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, **F32)
    assert (got[0] == 0).all()  # the empty slot attends to nothing


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=CPP), "torch"])
@pytest.mark.parametrize("heads,lora,rope", [(4, 36, 8), (16, 512, 64), (5, 64, 16)])
def test_decode_cpu_paths_bfloat16(impl, heads, lora, rope):
    """bfloat16 pool and queries, float32 sums: within bfloat16 rounding of the float64 reference on the
    same values (the C++ kernel rounds p to bfloat16 for its P x C where the CPU has AVX-512 BF16)."""
    case = _case(torch.bfloat16, LENS, heads, lora, rope)
    got = IMPLS[impl](*case, 0.1, lora)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _want(*case, 0.1, lora), **LOOSE[torch.bfloat16])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_triton(dtype, num_splits):
    """Split-K over a row's tokens (one split writes the output directly, else the reduce merges them),
    18 heads = two head blocks, the second masked; L 36 and R 8 padded to the kernel's tiles."""
    case = _case(dtype, [0, 1, 33, 50], heads=18, lora=36, rope=8, block_size=8)
    got = md.paged_mla_decode_triton(*case, 0.2, 36, num_splits=num_splits)
    tol = F32 if dtype == torch.float32 else LOOSE[dtype]
    torch.testing.assert_close(got.double(), _want(*case, 0.2, 36), **tol)


def test_dispatch_triton_branch_and_torch_fallback(monkeypatch):
    """float16 on CPU takes the torch path; CUDA tensors the Triton one (forced here on CPU tensors: the
    real kernel under the interpreter, its splits planned from max_context_len)."""
    case = _case(torch.float16, [5, 33])
    want = _want(*case, 0.3, 36)
    torch.testing.assert_close(md.paged_mla_decode(*case, 0.3, 36).double(), want, **LOOSE[torch.float16])
    monkeypatch.setattr(md, "use_triton", lambda *tensors: True)
    got = md.paged_mla_decode(*case, 0.3, 36, max_context_len=33)
    torch.testing.assert_close(got.double(), want, **LOOSE[torch.float16])


@CPP
def test_cpu_kernel_dispatch_and_path():
    """The dispatcher takes the C++ kernel for float32/bfloat16 CPU tensors of one dtype; the build names
    the path each dtype takes: vdpbf16ps for bfloat16 where the CPU has AVX-512 BF16."""
    q, cache, _, _ = _case(torch.float32, [5])
    assert md.mla_cpu_kernel_fits(q, cache) and md.mla_cpu_kernel_fits(q.bfloat16(), cache.bfloat16())
    assert not md.mla_cpu_kernel_fits(q.half(), cache.half())
    assert not md.mla_cpu_kernel_fits(q.bfloat16(), cache)
    line = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")), "")
    vector = cpu_kernels().paged_decode_simd()
    assert cpu_kernels().mla_decode_path(torch.float32) == vector
    bf16 = "avx512_bf16" if "avx512_bf16" in line.split() else vector
    assert cpu_kernels().mla_decode_path(torch.bfloat16) == bf16


@CPP
@pytest.mark.parametrize("lens", [[2000], [1000, 7, 300, 65, 1, 0], [9] * 12])
def test_cpu_kernel_shares_rows_between_threads(lens):
    """On 2 threads the batch's tokens are cut into one range per thread: a long row is split and its
    pieces merged (first two cases), short rows are never cut; the same result on 1 thread."""
    case = _case(torch.float32, lens, heads=8, lora=64, rope=16)
    want = _want(*case, 0.1, 64)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.testing.assert_close(md.paged_mla_decode_cpu(*case, 0.1, 64).double(), want, **F32)
    finally:
        torch.set_num_threads(threads)


@CPP
def test_cpu_kernel_refuses_bad_block_tables():
    """An entry outside the pool or a table too short for its row's length is an error, not a wild read."""
    q, cache, tables, lens = _case(torch.float32, [20, 40])
    bad = tables.clone()
    bad[1, 2] = cache.shape[0]  # the 3rd of the 3 blocks 40 tokens need
    with pytest.raises(RuntimeError, match="outside the pool"):
        md.paged_mla_decode_cpu(q, cache, bad, lens, 0.1, 36)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        md.paged_mla_decode_cpu(q, cache, tables[:, :2], lens, 0.1, 36)


def test_dispatcher_names_bad_shapes():
    q, cache, tables, lens = _case(torch.float32, [5, 9])
    with pytest.raises(ValueError, match="same width"):
        md.paged_mla_decode(q[..., :-1], cache, tables, lens, 0.1, 36)
    with pytest.raises(ValueError, match="kv_lora_rank 45"):
        md.paged_mla_decode(q, cache, tables, lens, 0.1, 45)
    with pytest.raises(ValueError, match="one block table"):
        md.paged_mla_decode(q, cache, tables[:1], lens, 0.1, 36)
    with pytest.raises(ValueError, match="latent"):
        md.mla_cache_write(torch.zeros(3, 36), torch.zeros(3, 9), cache, torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("impl", ["triton", "torch", "dispatch", pytest.param("cpu", marks=CPP)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mla_cache_write(impl, dtype):
    """Written slots hold latent then k_pe, every other slot is still NaN; -1 skips a token."""
    if (impl, dtype) in (("triton", torch.bfloat16), ("cpu", torch.float16)):
        pytest.skip("triton: fp32/fp16 under the interpreter; the C++ copy: fp32/bf16")
    latent, k_pe = torch.randn(9, 36).to(dtype), torch.randn(9, 8).to(dtype)
    slots = torch.randperm(20)[:9]
    slots[[2, 5]] = -1
    cache = torch.full((5, 4, 44), float("nan"), dtype=dtype)
    want = cache.clone()
    ref.mla_cache_write_ref(latent, k_pe, want, slots)
    fn = {"triton": md.mla_cache_write_triton, "torch": md.mla_cache_write_torch, "dispatch": md.mla_cache_write}
    (fn[impl] if impl in fn else cpu_kernels().mla_cache_write)(latent, k_pe, cache, slots)
    torch.testing.assert_close(cache, want, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(cache).sum() == cache.numel() - 7 * 44
