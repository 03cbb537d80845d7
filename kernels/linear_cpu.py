"""CPU linear layers for inference with the weight packed once, at load: bf16 through oneDNN,
fp32 through MKL's packed SGEMM (through oneDNN on non-Intel AVX-512 CPUs), and bf16 through MKL's
fp32 path where oneDNN has no bf16.

bf16: torch's `F.linear` on a bf16 CPU tensor goes to oneDNN, which reorders the plain [N, K] weight
into its blocked (AMX / AVX-512 BF16) layout on every call. At decode (M = the batch, 1-64 rows)
that reorder costs a third of the call or more (the weight is read, written and read again), and a bf16 GEMV came
out no faster than fp32's, which moves twice the bytes. `torch.ops.mkldnn._reorder_linear_weight`
(what inductor's freezing pass uses) does the reorder once; `_linear_pointwise` then multiplies
with it. Measured over the 110M serving model's linears (docs/benchmarks.md, "Serving speed"):
1.26-1.38x faster than bf16 F.linear at M = 1..64 and 1.11x at a prefill chunk (M = 2048), so one
packed copy replaces the plain weight for every M and serving keeps no second copy. A hand-written
AVX-512 BF16 GEMV (`_mm512_dpbf16_ps` over the row-major weight) was measured too: ~10% faster than
this at M = 1 but slower from M = 4 (no AMX), and it needs the plain weight beside the packed one,
so it was not kept.

fp32: `F.linear` is MKL's SGEMM, which packs the weight into its panel layout on every call too;
at decode batches (M = 16-64) that is ~30% of the call. MKL's packed API does it once:
`cblas_sgemm_pack` at load, `cblas_sgemm_compute` per call (both exported by libtorch_cpu, where
torch's x86 wheels link MKL; called through ctypes, so nothing is compiled). torch's own wrapper
(`torch.ops.mkl._mkl_linear`) takes the packed path only at the one batch size it was packed for
and falls back to the plain weight otherwise, so it cannot replace the weight. The pack's row hint
(FP32_PACK_ROWS) picks MKL's blocking: measured over the 25M serving model's linears, 64 rows gave
1.4x at M = 32-64, 1.1x at M = 8, 1.0-1.08x at M = 1 and 0.97-1.0x at M = 2048 (1 and 2048 rows
lost at decode). Results equal F.linear's bit for bit from M = 17 (the same MKL kernels); below
that F.linear takes a GEMV path whose sums differ in the last bits (tests/kernels/test_linear_cpu.py
bounds both against a float64 reference). MKL forbids moving a packed buffer: it is held as a
plain attribute (no state_dict, `.to()` or deepcopy of it) and a PackedLinear refuses a deepcopy.

fp32 on a CPU with AVX-512 that is not Intel's (AMD Zen 4/5): MKL's SGEMM runs its AVX2 kernels
there (its AVX-512 ones are Intel-only), while oneDNN JITs for the CPU it finds. Measured on an AMD
EPYC with AVX-512 (2 threads, the 25M/110M serving shapes): MKL's packed SGEMM 146-194 GFLOP/s,
oneDNN's fp32 `_linear_pointwise` over a weight reordered once 325-470 (2.0-2.5x at M = 2048,
2.4-3.3x at M = 16-64, 1.3-3.2x at M = 1). So fp32 takes oneDNN there (`fp32_path`; the same
reorder as bf16's) and MKL elsewhere (measured at the ceiling on Zen 2 and packed-best on Intel).
`BATON_CPU_FP32_LINEAR=mkl|onednn` overrides the choice (for measuring one against the other).

bf16 without oneDNN bf16 (a CPU without AVX-512 BF16 / AMX, e.g. AMD Zen 2): torch's bf16 `F.linear`
there emulates bf16 and ran 4-13x slower than fp32's (25M serving shapes, docs/benchmarks.md, "bf16
linear layers"). The weight is widened to fp32 once at load and packed through MKL as above
(`bf16_path`), and each call widens x, multiplies in fp32, adds the bias and rounds to bf16 once:
products of bf16 values are exact in fp32 and the sums are fp32, so this is `linear_reference`'s
bf16 specification up to summation order. The cost: the packed weight takes 2x the bf16 weight's
memory (logged once), and every call reads 4 bytes per weight instead of 2.

Baton's own GEMM (csrc/gemm_cpu.cpp), once a server has loaded the C++ kernels: on AMD Zen 4 (2
cores, the 110M serving model's linears cycling through 8 layers, docs/benchmarks.md) it streams the
weights at ~50 GB/s where oneDNN's small-M kernels reach ~22, and keeps the FMAs busier at M = 16-64:
bf16 1.4-1.6x oneDNN at M = 1-8, 1.04-1.26x at 12-64, level at 256-2048; fp32 1.4-1.7x at M = 1-8,
1.04-1.22x at 12-64, 0.95-1.05x at 256-2048. So it is the default where measured: fp32 on AVX-512 CPUs
that are not Intel's, bf16 on AVX-512 BF16 CPUs without AMX (oneDNN's AMX tiles are the faster
prefill there). BATON_CPU_FP32_LINEAR=baton|mkl|onednn and BATON_CPU_BF16_LINEAR=baton|onednn
override the choice. Its sums run over k in order for every row, so a row's output does not depend
on the batch it came in (oneDNN's and MKL's blocking does not promise that).

Falls back to `F.linear` (`prepacked_available(dtype)` false) where torch has no MKL (and, for bf16,
no oneDNN bf16) and Baton's GEMM is not there, or with BATON_CPU_PACKED_LINEAR=0. CPU only: CUDA
tensors never take this path.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_extension import cpu_kernels

PACK_ROWS = 2048  # bf16: a prefill chunk (the serving benchmarks run 2,048 batched tokens per step)
FP32_PACK_ROWS = 64  # fp32: MKL's blocking for decode batches (module docstring); oneDNN's within 3% of 2048's
_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151  # mkl_cblas.h's enums
PROFILER_NAME = "baton::packed_sgemm"  # MKL's GEMM's range in a torch profile (oneDNN's is mkldnn::_linear_pointwise)
GEMM_PROFILER_NAME = "baton::gemm"  # Baton's GEMM's (csrc/gemm_cpu.cpp records it)
_NO_RANGE = contextlib.nullcontext()
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Sgemm:
    get_size: ctypes._CFuncPtr
    pack: ctypes._CFuncPtr
    compute: ctypes._CFuncPtr


def _load_sgemm() -> _Sgemm | None:
    """MKL's packed-SGEMM entry points in the libtorch_cpu already loaded, or None."""
    if not torch.backends.mkl.is_available():
        return None
    lib_dir = Path(torch.__file__).parent / "lib"
    libs = sorted(lib_dir.glob("libtorch_cpu.*")) + sorted(lib_dir.glob("torch_cpu.dll"))
    if not libs:
        return None
    lib = ctypes.CDLL(str(libs[0]))
    names = ("cblas_sgemm_pack_get_size", "cblas_sgemm_pack", "cblas_sgemm_compute")
    if not all(hasattr(lib, n) for n in names):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p  # MKL_INT is 32-bit in torch's LP64 MKL
    get_size, pack, compute = (getattr(lib, n) for n in names)
    get_size.restype, get_size.argtypes = ctypes.c_size_t, [i, i, i, i]
    pack.restype, pack.argtypes = None, [i, i, i, i, i, i, f, p, i, p]
    compute.restype, compute.argtypes = None, [i, i, i, i, i, i, p, i, p, i, f, p, i]
    return _Sgemm(get_size, pack, compute)


def _mkldnn_linear() -> bool:
    mk = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mk, "_reorder_linear_weight")
        and hasattr(mk, "_linear_pointwise")
    )


def _mkldnn_bf16() -> bool:
    return _mkldnn_linear() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo ("vendor_id", "flags"), or ""."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    return ""


def _cpu_vendor() -> str:
    return _cpuinfo("vendor_id") or "unknown"


def fp32_path(onednn: bool, mkl_sgemm: bool, avx512: bool, intel: bool, choice: str = "") -> str | None:
    """Which packed path fp32 linears take: `choice` ("mkl" / "onednn", BATON_CPU_FP32_LINEAR) where
    available; else "onednn" on an AVX-512 CPU that is not Intel's (MKL runs AVX2 kernels there),
    else "mkl", else "onednn" where only it exists, else None."""
    have = {"onednn": onednn, "mkl": mkl_sgemm}
    if choice and choice not in (*have, "baton"):
        raise ValueError(f"BATON_CPU_FP32_LINEAR={choice!r}: 'baton', 'mkl' or 'onednn' (or unset: chosen by the CPU)")
    if choice == "baton":  # Baton's GEMM where it is there (gemm_choice); this is the path without it
        choice = ""
    if have.get(choice):
        return choice
    if choice:
        log.warning("BATON_CPU_FP32_LINEAR=%s: this torch has no %s; choosing by the CPU", choice, choice)
    if onednn and (avx512 and not intel or not mkl_sgemm):
        return "onednn"
    return "mkl" if mkl_sgemm else None


@functools.cache
def _fp32_path() -> str | None:
    try:
        onednn = _mkldnn_linear()
    except (RuntimeError, AttributeError):
        onednn = False
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    choice = os.environ.get("BATON_CPU_FP32_LINEAR", "")
    return fp32_path(onednn, _sgemm() is not None, avx512, _cpu_vendor() == "GenuineIntel", choice)


@functools.cache
def _sgemm() -> _Sgemm | None:
    try:
        return _load_sgemm()
    except OSError:  # the library would not load
        return None


def bf16_path(onednn_bf16: bool, mkl_sgemm: bool) -> str | None:
    """Which packed path bf16 linears take: "onednn" where oneDNN has bf16 (half the bytes of fp32,
    AMX / AVX-512 BF16), else "mkl-fp32" (the weight widened once, MKL's packed SGEMM), else None."""
    return "onednn" if onednn_bf16 else "mkl-fp32" if mkl_sgemm else None


@functools.cache
def _bf16_path() -> str | None:
    try:
        onednn = _mkldnn_bf16()
    except (RuntimeError, AttributeError):  # a torch built without oneDNN's ops
        onednn = False
    return bf16_path(onednn, _sgemm() is not None)


def gemm_choice(dtype: torch.dtype, available: bool, intel: bool, amx: bool, choice: str = "") -> bool:
    """Whether `dtype`'s linears take Baton's GEMM: `choice` (BATON_CPU_FP32_LINEAR /
    BATON_CPU_BF16_LINEAR) decides where given; else where it was measured ahead: fp32 on CPUs that
    are not Intel's, bf16 where oneDNN has no AMX."""
    var, paths = (
        ("BATON_CPU_FP32_LINEAR", ("baton", "mkl", "onednn"))
        if dtype == torch.float32
        else ("BATON_CPU_BF16_LINEAR", ("baton", "onednn"))
    )
    if choice and choice not in paths:
        raise ValueError(f"{var}={choice!r}: one of {', '.join(map(repr, paths))} (or unset: chosen by the CPU)")
    if choice == "baton" and not available:
        log.warning("%s=baton: Baton's GEMM is not built for this CPU (AVX-512, AVX-512 BF16 for bf16); not used", var)
    if not available or choice:
        return available and choice == "baton"
    return not intel if dtype == torch.float32 else not amx


def _gemm_kernels(dtype: torch.dtype):
    """The C++ kernels' module if it has Baton's GEMM for `dtype`: only once a server loaded the
    kernels (cpu_kernels ran; this never builds them)."""
    if dtype not in (torch.float32, torch.bfloat16) or not cpu_kernels.cache_info().currsize:
        return None
    ck = cpu_kernels()
    return ck if ck is not None and ck.gemm_available(dtype) else None


def _gemm(dtype: torch.dtype):
    """The C++ kernels' module if `dtype`'s linears take Baton's GEMM (gemm_choice for this CPU)."""
    ck = _gemm_kernels(dtype)
    return ck if _gemm_chosen(dtype, ck is not None) else None


@functools.cache
def _gemm_chosen(dtype: torch.dtype, available: bool) -> bool:
    var = "BATON_CPU_FP32_LINEAR" if dtype == torch.float32 else "BATON_CPU_BF16_LINEAR"
    amx = "amx_bf16" in _cpuinfo("flags").split()
    return gemm_choice(dtype, available, _cpu_vendor() == "GenuineIntel", amx, os.environ.get(var, ""))


@functools.cache
def _supported(dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return _fp32_path() is not None
    return dtype == torch.bfloat16 and _bf16_path() is not None


@functools.cache
def _log_widening() -> None:
    log.info(
        "oneDNN has no bf16 on this CPU: bf16 linear weights are widened to fp32 once and run through "
        "MKL's packed SGEMM (twice the bf16 weight memory; outputs rounded to bf16 once)"
    )


def prepacked_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether CPU linears of `dtype` (bf16 or fp32) can run from a once-packed weight here (and may)."""
    return os.environ.get("BATON_CPU_PACKED_LINEAR", "1") != "0" and (_supported(dtype) or _gemm(dtype) is not None)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedWeight:
    """An [N, K] weight packed once, as `kind` says: "baton" (gemm_pack's panels), "onednn" (a oneDNN
    opaque tensor) or "mkl" (MKL's packed fp32 buffer, which must never move: its metadata depends
    on the address's alignment); `dtype` is the layer's (a bf16 weight widened into MKL's fp32
    buffer keeps bf16 here, and `data.dtype` is float32)."""

    data: torch.Tensor
    out_features: int
    in_features: int
    dtype: torch.dtype
    kind: str

    def __deepcopy__(self, memo):
        raise TypeError("a packed CPU weight cannot be copied (MKL's buffer must not move): pack the plain weight")


def pack_weight(weight: torch.Tensor, gemm: bool | None = None) -> PackedWeight:
    """The [N, K] bf16 or fp32 CPU weight packed for `packed_linear`: for Baton's GEMM where this CPU
    takes it (`gemm` None), always (True: the kernels must be loaded and have it) or never (False,
    the path the CPU takes without it; both for measuring one against the other). bf16: oneDNN picks its blocked
    layout for a batch size; the one for PACK_ROWS rows measured within 4% of the M = 1 layout at
    decode (M = 1, 8) and up to 1.4x faster than it at prefill (M = 64..2048, the down projection).
    Without oneDNN bf16 a bf16 weight is widened to fp32 and packed by MKL: 2x its memory."""
    ok = weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
    if not ok or weight.dim() != 2 or not weight.numel():
        raise ValueError(
            "pack_weight: a non-empty 2-D bfloat16 or float32 CPU weight, "
            f"got {tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    n, k = weight.shape
    w = weight.detach().contiguous()
    ck = _gemm(weight.dtype) if gemm is None else _gemm_kernels(weight.dtype) if gemm else None
    if gemm and ck is None:
        raise ValueError(
            f"pack_weight(gemm=True): no {weight.dtype} GEMM loaded (cpu_kernels(), AVX-512 / AVX-512 BF16)"
        )
    if ck is not None:
        return PackedWeight(ck.gemm_pack(w), n, k, weight.dtype, "baton")
    if weight.dtype == torch.bfloat16 and _bf16_path() == "onednn":
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS), n, k, weight.dtype, "onednn")
    if weight.dtype == torch.float32 and _fp32_path() == "onednn":
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, FP32_PACK_ROWS), n, k, weight.dtype, "onednn")
    mkl = _sgemm()
    if mkl is None:
        raise ValueError("pack_weight: this torch has no MKL packed SGEMM (see prepacked_available)")
    if weight.dtype == torch.bfloat16:
        _log_widening()
        w = w.float()  # exact; freed once packed
    size = mkl.get_size(_B_MATRIX, FP32_PACK_ROWS, n, k)
    buf = torch.empty(-(-size // 4), dtype=torch.float32)  # untouched pages cost no memory
    mkl.pack(_ROW_MAJOR, _B_MATRIX, _TRANS, FP32_PACK_ROWS, n, k, 1.0, w.data_ptr(), k, buf.data_ptr())
    return PackedWeight(buf, n, k, weight.dtype, "mkl")


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times a `pack_weight` result, plus bias: F.linear's value (bf16: float32
    accumulation, one rounding to bf16; through MKL, x widened to fp32 first). No autograd: inference only."""
    k, n = packed.in_features, packed.out_features
    if x.dtype != packed.dtype or x.shape[-1] != k or x.device.type != "cpu":
        raise ValueError(f"packed_linear: x {tuple(x.shape)} {x.dtype} for a {packed.dtype} [{n}, {k}] weight")
    x2 = x.reshape(-1, k)
    if packed.kind == "baton":
        y = cpu_kernels().gemm_linear(x2, packed.data, bias, n)
    elif packed.kind == "onednn":
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed.data, bias, "none", [], "")
    else:
        x2 = x2.to(torch.float32).contiguous()
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        if y.numel():
            # a ctypes call is invisible to torch's profiler: name it there (only while one records)
            with torch.profiler.record_function(PROFILER_NAME) if torch.autograd._profiler_enabled() else _NO_RANGE:
                _sgemm().compute(_ROW_MAJOR, _NO_TRANS, _PACKED, x2.shape[0], n, k, x2.data_ptr(), k,
                                 packed.data.data_ptr(), k, 0.0, y.data_ptr(), n)  # fmt: skip
        if bias is not None:
            y += bias  # in fp32, before the one rounding to bf16
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], n)


def sgemm_compute_address() -> int:
    """The address of MKL's cblas_sgemm_compute (for C++ callers of a packed weight, as the CPU
    decoder stack is); 0 where this torch has none."""
    mkl = _sgemm()
    return 0 if mkl is None else ctypes.cast(mkl.compute, ctypes.c_void_p).value or 0


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The specification: the inputs multiplied in float64 (bf16: float32), rounded to x's dtype once."""
    wide = torch.float64 if x.dtype == torch.float32 else torch.float32
    return F.linear(x.to(wide), weight.to(wide), None if bias is None else bias.to(wide)).to(x.dtype)


class PackedLinear(nn.Module):
    """An inference-only nn.Linear whose weight lives packed (`pack_weight`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """In place: every plain bf16 or fp32 CPU nn.Linear (no hooks; its weight not shared with another
    module, as a tied LM head's is with the embedding) becomes a PackedLinear, so the plain weight
    is freed. Returns how many were packed; none of a dtype where `prepacked_available(dtype)` is false."""
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    todo = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and not child._forward_hooks
        and not child._forward_pre_hooks
        and child.weight.device.type == "cpu"
        and child.weight.dtype in (torch.bfloat16, torch.float32)
        and child.weight.numel()
        and prepacked_available(child.weight.dtype)
        and id(child.weight) not in shared
    ]
    for parent, name, child in todo:
        setattr(parent, name, PackedLinear(child))
    return len(todo)
