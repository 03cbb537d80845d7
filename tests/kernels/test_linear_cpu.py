"""CPU linears from a once-packed weight (kernels/linear_cpu.py: Baton's GEMM; bf16 through oneDNN or,
without it, widened through MKL's fp32 path; fp32 through MKL or oneDNN) against float32 / float64
references, which path each dtype takes, the model runner's use of them (greedy tokens equal the
plain path's), and the fallback."""

import copy
import dataclasses

import pytest
import torch
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.kernels import linear_cpu
from baton.kernels.cpu_extension import cpu_kernels
from baton.kernels.linear_cpu import PackedLinear, linear_reference, pack_linears, pack_weight, packed_linear
from baton.serve.core.sequence import Sequence
from baton.serve.runner.model_runner import ModelRunner
from baton.serve.sampling_params import SamplingParams

from ..system import require

needs_bf16 = pytest.mark.skipif(not linear_cpu.prepacked_available(), reason="neither oneDNN bf16 nor MKL here")
needs_mkl = pytest.mark.skipif(not linear_cpu.prepacked_available(torch.float32), reason="torch without MKL")
PACKABLE = [pytest.param(torch.bfloat16, marks=needs_bf16), pytest.param(torch.float32, marks=needs_mkl)]
BF16 = {"rtol": 2**-7, "atol": 1e-6}  # one rounding of the float32 sum to bf16 apart at most

CFG = ModelConfig(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=136,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def gemm_kernels(dtype: torch.dtype):
    """The C++ kernels if this machine's build has Baton's GEMM for `dtype`, else None (a CPU without
    its features). The build needs a C++ compiler, required here (tests/system.py) so that a missing
    one is not taken for the CPU's features."""
    require("c++")
    ck = cpu_kernels()
    return ck if ck is not None and ck.gemm_available(dtype) else None


@pytest.fixture
def take(monkeypatch):
    """take(path, dtype): pack_weight packs `dtype` for `path` ("baton", or the other path this
    machine chooses for it), whatever the CPU and the kernels' state would choose."""

    def take(path: str, dtype: torch.dtype) -> None:
        if path == "baton" and gemm_kernels(dtype) is None:
            pytest.skip(f"no {dtype} GEMM in this build (AVX-512 / AVX-512 BF16)")
        ck = gemm_kernels(dtype) if path == "baton" else None
        monkeypatch.setattr(linear_cpu, "_gemm", lambda dt: ck)
        if dtype == torch.float32 and path != "baton":
            monkeypatch.setattr(linear_cpu, "_fp32_path", lambda: path)

    return take


BF16_PATHS = ["baton", pytest.param("other", marks=needs_bf16)]


@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("m,n,k", [(1, 1536, 1024), (3, 7, 33), (8, 96, 2816), (5, 13, 100), (64, 17, 63), (2, 1, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_the_float32_reference(take, path, m, n, k, bias):
    take(path, torch.bfloat16)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(2, m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    with torch.inference_mode():
        y = packed_linear(x, pack_weight(w), b)
    assert y.shape == (2, m, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), linear_reference(x, w, b).float(), **BF16)


FP32_PATHS = [
    "baton",
    pytest.param("mkl", marks=pytest.mark.skipif(linear_cpu._sgemm() is None, reason="torch without MKL")),
    pytest.param("onednn", marks=pytest.mark.skipif(not linear_cpu._mkldnn_linear(), reason="torch without oneDNN")),
]


@pytest.mark.parametrize("path", FP32_PATHS)
@pytest.mark.parametrize(
    "m,n,k", [(1, 1536, 1024), (3, 7, 33), (16, 96, 2816), (17, 96, 2816), (64, 17, 63), (300, 5, 1)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_packed_linear_matches_the_float64_reference(take, path, m, n, k, bias):
    """Every fp32 path at every batch size (one pack serves all M; MKL's row hint is 64), as close
    to the float64 product as F.linear's own SGEMM is."""
    take(path, torch.float32)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(2, m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    with torch.inference_mode():
        packed = pack_weight(w)
        y = packed_linear(x, packed, b)
    ref = linear_reference(x, w, b)
    assert packed.kind == path and packed.data.is_mkldnn == (path == "onednn")
    assert y.shape == (2, m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    plain_err = (torch.nn.functional.linear(x, w, b) - ref).abs().max()
    assert (y - ref).abs().max() <= 4 * plain_err + 1e-6


def test_bf16_takes_onednn_where_it_has_bf16_else_mkl_fp32():
    assert linear_cpu.bf16_path(onednn_bf16=True, mkl_sgemm=True) == "onednn"
    assert linear_cpu.bf16_path(onednn_bf16=True, mkl_sgemm=False) == "onednn"
    assert linear_cpu.bf16_path(onednn_bf16=False, mkl_sgemm=True) == "mkl-fp32"
    assert linear_cpu.bf16_path(onednn_bf16=False, mkl_sgemm=False) is None
    # and pack_weight follows the choice this machine makes: a oneDNN bf16 tensor or MKL's fp32 buffer
    here = linear_cpu.bf16_path(linear_cpu._mkldnn_bf16(), linear_cpu._sgemm() is not None)
    assert linear_cpu._bf16_path() == here
    if here is not None:
        packed = pack_weight(torch.randn(8, 16).bfloat16())
        assert packed.dtype == torch.bfloat16
        assert packed.data.dtype == {"onednn": torch.bfloat16, "mkl-fp32": torch.float32}[here]


def test_fp32_takes_onednn_on_avx512_cpus_not_intels_else_mkl():
    def path(onednn=True, mkl=True, avx512=True, intel=False, choice=""):
        return linear_cpu.fp32_path(onednn, mkl, avx512, intel, choice)

    assert path() == "onednn"  # e.g. an AMD EPYC with AVX-512: MKL would run its AVX2 kernels
    assert path(intel=True) == "mkl" and path(avx512=False) == "mkl"  # Intel; Zen 2 (AVX2 only)
    assert path(mkl=False, avx512=False) == "onednn" and path(onednn=False) == "mkl"
    assert path(onednn=False, mkl=False) is None
    assert path(choice="mkl") == "mkl" and path(intel=True, choice="onednn") == "onednn"  # the override
    assert path(onednn=False, choice="onednn") == "mkl"  # an override it cannot take falls back
    assert path(choice="baton") == "onednn"  # the path where Baton's GEMM is not there
    with pytest.raises(ValueError, match="BATON_CPU_FP32_LINEAR.*'mkl' or 'onednn'"):
        path(choice="mlk")


def test_baton_gemm_is_chosen_where_measured_ahead_or_asked_for():
    def choose(dtype, available=True, intel=False, amx=False, choice=""):
        return linear_cpu.gemm_choice(dtype, available, intel, amx, choice)

    f32, bf16 = torch.float32, torch.bfloat16
    assert choose(f32) and choose(bf16)  # AMD Zen 4: AVX-512 BF16, no AMX
    assert not choose(f32, intel=True) and choose(bf16, intel=True)  # MKL's own CPU keeps MKL for fp32
    assert not choose(bf16, amx=True) and choose(f32, amx=True)  # AMX: oneDNN's bf16 tiles
    assert choose(f32, intel=True, choice="baton") and choose(bf16, amx=True, choice="baton")
    assert not choose(f32, choice="mkl") and not choose(bf16, choice="onednn")
    assert not choose(f32, available=False) and not choose(bf16, available=False, choice="baton")
    with pytest.raises(ValueError, match="BATON_CPU_BF16_LINEAR='mkl'.*'baton', 'onednn'"):
        choose(bf16, choice="mkl")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_baton_gemm_gives_a_row_the_same_bits_alone_or_in_any_batch(take, dtype):
    """Each output is one sum over k in order, whatever M, the row's place or the thread split."""
    take("baton", dtype)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 1000, generator=g).to(dtype)
    w, b = (torch.randn(200, 1000, generator=g) / 32).to(dtype), torch.randn(200, generator=g).to(dtype)
    packed = pack_weight(w)
    whole = packed_linear(x, packed, b)
    for rows in (slice(0, 1), slice(7, 8), slice(5, 11), slice(250, 300)):
        assert torch.equal(packed_linear(x[rows], packed, b), whole[rows])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(packed_linear(x, packed, b), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_baton_gemm_takes_strided_rows_and_an_odd_k(take, dtype):
    """x may be a column slice (its rows strided, as a fused projection's halves are); a bf16 K
    that is odd pads the last k pair with a zero, never reading past a row."""
    take("baton", dtype)
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(9, 80, generator=g).to(dtype)
    x = wide[:, 3:72]  # K = 69, rows 80 apart
    w = torch.randn(70, 69, generator=g).to(dtype)
    y = packed_linear(x, pack_weight(w))
    assert torch.equal(y, packed_linear(x.contiguous(), pack_weight(w)))
    tol = BF16 if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(y.float(), linear_reference(x, w).float(), **tol)
    wide[:, 72:] = float("nan")  # what lies past the slice never reaches the sums
    assert torch.equal(packed_linear(wide[:, 3:72], pack_weight(w)), y)


@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("m", [1, 17, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_packed_linear_at_serving_shapes_matches_the_reference_as_f_linear_does(take, path, m, bias):
    """A 25M gate_up-sized weight (without oneDNN bf16: widened, MKL's fp32 GEMM, one rounding). The
    once-rounded float32 reference differs from it only by summation order, so outputs agree but for
    rare last-bit flips at rounding ties, no more often than bf16 F.linear's, and the error against
    the float64 product is of F.linear's size."""
    take(path, torch.bfloat16)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).bfloat16()
    w = (torch.randn(2816, 512, generator=g) / 512**0.5).bfloat16()
    b = torch.randn(2816, generator=g).bfloat16() if bias else None
    with torch.inference_mode():
        y = packed_linear(x, pack_weight(w), b)
        plain = torch.nn.functional.linear(x, w, b)
    ref = linear_reference(x, w, b)
    assert y.shape == (m, 2816) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), **BF16)
    assert (y != ref).sum() <= max(int((plain != ref).sum()), y.numel() // 1000)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert (y - exact).abs().max() <= 2 * (plain - exact).abs().max()


def test_pack_weight_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="bfloat16 or float32 CPU"):
        pack_weight(torch.randn(4, 8).half())
    with pytest.raises(ValueError, match="non-empty"):
        pack_weight(torch.randn(0, 8))


@needs_mkl
def test_packed_linear_refuses_a_mismatched_input_and_a_copy():
    packed = pack_weight(torch.randn(4, 8))
    with pytest.raises(ValueError, match="float32"):
        packed_linear(torch.randn(2, 8).bfloat16(), packed)
    with pytest.raises(ValueError, match=r"\[4, 8\]"):
        packed_linear(torch.randn(2, 7), packed)
    with pytest.raises(TypeError, match="cannot be copied"):  # MKL's buffer must not move
        copy.deepcopy(PackedLinear(torch.nn.Linear(8, 4)))


def greedy(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    """Prefill, then one decode row per step, each time the argmax token."""
    seq = Sequence(0, "r", 0, list(prompt), SamplingParams())
    seq.block_table = list(range(8))
    n = len(prompt)
    for _ in range(steps):
        logits = runner.execute([(seq, n)]).logits
        seq.num_computed_tokens += n
        seq.token_ids.append(int(logits[-1].argmax()))
        n = 1
    return seq.output_token_ids


@pytest.mark.parametrize("dtype", PACKABLE)
def test_the_model_runner_packs_linears_and_greedy_tokens_stay_the_same(monkeypatch, dtype):
    model = build_model(CFG, seed=0).to(dtype)
    packed = ModelRunner(copy.deepcopy(model), num_blocks=8, block_size=8)
    monkeypatch.setenv("BATON_CPU_PACKED_LINEAR", "0")
    plain = ModelRunner(model, num_blocks=8, block_size=8)
    # per layer the fused qkv_proj and gate_up_proj, o_proj and down_proj; and the (untied) LM head
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == 4 * CFG.num_hidden_layers + 1
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    prompt = torch.randint(0, CFG.vocab_size, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    # logits of the two paths agree to rounding; a near-tie could still flip an argmax, which these
    # seeds do not have (the accumulation is the same up to summation order)
    assert greedy(packed, prompt, 12) == greedy(plain, prompt, 12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_without_onednn_bf16_or_mkl_nothing_is_packed(monkeypatch, dtype):
    monkeypatch.setattr(linear_cpu, "_supported", lambda dtype: False)
    monkeypatch.setattr(linear_cpu, "_gemm", lambda dtype: None)
    model = build_model(CFG, seed=0).to(dtype)
    assert pack_linears(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("dtype", PACKABLE)
def test_a_tied_lm_head_keeps_its_shared_weight(dtype):
    model = build_model(dataclasses.replace(CFG, tie_word_embeddings=True), seed=0).to(dtype)
    assert pack_linears(model) == 7 * CFG.num_hidden_layers  # every projection; not the tied head
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_weight_can_be_told_to_take_batons_gemm_or_not(monkeypatch, dtype):
    """gemm=True / False override the CPU's choice (what the linear benchmark compares); True where
    the GEMM is not loaded is refused, naming it."""
    if gemm_kernels(dtype) is None:
        pytest.skip(f"no {dtype} GEMM in this build (AVX-512 / AVX-512 BF16)")
    w, x = torch.randn(40, 24).to(dtype), torch.randn(3, 24).to(dtype)
    ours, other = pack_weight(w, gemm=True), pack_weight(w, gemm=False)
    assert ours.kind == "baton" and other.kind != "baton"
    tol = BF16 if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(packed_linear(x, ours).float(), packed_linear(x, other).float(), **tol)
    monkeypatch.setattr(linear_cpu, "_gemm_kernels", lambda dt: None)
    with pytest.raises(ValueError, match="gemm=True.*no torch.* GEMM loaded"):
        pack_weight(w, gemm=True)


def test_batons_gemm_is_named_in_a_torch_profile(take):
    """The C++ call records GEMM_PROFILER_NAME, so profiles (serve_parallel's matmul share) count it."""
    take("baton", torch.float32)
    packed = pack_weight(torch.randn(64, 32))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        packed_linear(torch.randn(4, 32), packed)
    assert linear_cpu.GEMM_PROFILER_NAME in {e.key for e in prof.key_averages()}


def test_batons_gemm_refuses_a_bias_of_the_wrong_length(take):
    """The C++ call reads the bias out_features wide: any other length is refused, never read past."""
    take("baton", torch.float32)
    with pytest.raises(RuntimeError, match="a bias of 16 values, got 15"):
        packed_linear(torch.randn(2, 8), pack_weight(torch.randn(16, 8)), torch.randn(15))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter,k", [(64, 100), (192, 33), (2816, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_swiglu_is_the_gemm_then_swiglu_bit_for_bit(dtype, inter, k, bias):
    """The fused gate/up GEMM's epilogue (silu(gate) * up from the tiles) stores exactly what
    gemm_linear's [rows, 2I] output through swiglu() would: any M, odd K, with and without bias."""
    ck = gemm_kernels(dtype)
    if ck is None:
        pytest.skip(f"no {dtype} GEMM in this build (AVX-512 / AVX-512 BF16)")
    g = torch.Generator().manual_seed(5)
    packed = ck.gemm_pack((torch.randn(2 * inter, k, generator=g) / 8).to(dtype))
    b = torch.randn(2 * inter, generator=g).to(dtype) if bias else None
    for m in (1, 5, 7, 36, 65, 300):
        x = (torch.randn(m, k, generator=g) * 3).to(dtype)
        gu = ck.gemm_linear(x, packed, b, 2 * inter)
        want = ck.swiglu(gu[:, :inter], gu[:, inter:])
        assert torch.equal(ck.gemm_swiglu(x, packed, b, inter), want)
    ref = torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()  # and it is SwiGLU
    torch.testing.assert_close(want.float(), ref, **(BF16 if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}))


def test_gemm_swiglu_refuses_a_weight_it_cannot_split():
    """The gate half must be whole panels (intermediate a multiple of 64) and the weight 2 x it."""
    ck = gemm_kernels(torch.float32)
    if ck is None:
        pytest.skip("no float32 GEMM in this build (AVX-512)")
    packed = ck.gemm_pack(torch.randn(2 * 80, 16))
    with pytest.raises(RuntimeError, match="gemm_swiglu: a fused gate/up weight of 2 x 80 outputs"):
        ck.gemm_swiglu(torch.randn(2, 16), packed, None, 80)
    packed = ck.gemm_pack(torch.randn(2 * 64, 16))
    with pytest.raises(RuntimeError, match="a fused gate/up weight of 2 x 128 outputs"):
        ck.gemm_swiglu(torch.randn(2, 16), packed, None, 128)
    with pytest.raises(RuntimeError, match="a bias of 128 values, got 64"):
        ck.gemm_swiglu(torch.randn(2, 16), packed, torch.randn(64), 64)
    with pytest.raises(RuntimeError, match="does not fit the packed weight"):
        ck.gemm_swiglu(torch.randn(2, 15), packed, None, 64)
