"""Builds (once per machine, with torch's JIT extension builder) and loads Baton's C++ CPU kernels.

Paged decode attention: on CPU the torch path gathers every sequence's K/V blocks into a padded
copy before SDPA, and that copy, not the arithmetic, is most of a decode step's attention time;
the C++ kernel reads the pools in place (csrc/paged_decode_cpu.cpp). The fused elementwise ops
(RMSNorm with its residual add, rotary of q and k: csrc/elementwise_cpu.cpp) replace 5-10 torch
ops each, whose dispatch dominates at decode shapes; they are used only once something that
serves (the model runner) has loaded the kernels - `loaded_cpu_kernels` - so training and tests
never build them as a side effect. Without a C++ compiler
the build fails once, a warning says so, and the torch path is used; BATON_CPU_KERNELS=0 skips it.

One process builds or loads a build folder at a time, under an flock (`builder_lock`) that the
kernel drops when its holder dies: torch's own `lock` file, which its builder waits on forever and
a killed build leaves behind, is then always a dead builder's, and is removed at once (it used to
take a 10-minute staleness rule, during which a server that started after a killed one waited).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

NAME = "baton_cpu_kernels"
SOURCES = [
    Path(__file__).resolve().parent / "csrc" / f
    for f in (
        "bindings.cpp",
        "paged_decode_cpu.cpp",
        "mla_decode_cpu.cpp",
        "elementwise_cpu.cpp",
        "argmax_cpu.cpp",
        "decoder_cpu.cpp",
        "gemm_cpu.cpp",
    )
]
# included by the sources, so in the build folder's source hash too
HEADERS = [Path(__file__).resolve().parent / "csrc" / h for h in ("simd_cpu.h", "cpu_kernels.h")]
# -march=native: built for this CPU (the build folder is named after its flags, below);
# -fopenmp: at::parallel_for splits the work between torch's threads only when OpenMP is on.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def build_directory() -> Path:
    """One folder per Python, torch, CPU feature set and source (its text and its folder), under
    torch's extensions root, so a home directory shared between machines, venvs or checkouts never
    loads (or rebuilds over) a build made for another: two checkouts would otherwise rebuild the
    same folder back and forth, each waiting on the other's lock."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    cpu = hashlib.sha1(flags.encode()).hexdigest()[:8]
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    # the sources' folder too: torch's build.ninja names them by path, so two checkouts of the same
    # text sharing one folder would still rebuild it back and forth
    text = str(SOURCES[0].parent).encode() + b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    src = hashlib.sha1(text).hexdigest()[:8]
    py, version = f"{sys.version_info.major}{sys.version_info.minor}", torch.__version__.split("+")[0]
    tag = f"py{py}-torch{version}-cpu{cpu}-src{src}-flock"  # -flock: built under builder_lock only
    return root / f"{NAME}-{tag}"


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None (disabled, or the build failed: then the torch paths run)."""
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        return None
    from torch.utils.cpp_extension import load

    folder = build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    log.info("loading Baton's C++ CPU kernels from %s (the first time on a machine builds them: ~1 min)", folder)
    try:
        with builder_lock(folder):
            return load(
                NAME,
                [str(s) for s in SOURCES],
                extra_cflags=FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
            )
    except Exception as e:  # no compiler, no ninja, a failed build: fall back, say so once
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        log.warning(
            "could not build Baton's C++ CPU kernels (%s: %s); using the slower torch paths", type(e).__name__, last
        )
        return None


@contextlib.contextmanager
def builder_lock(folder: Path):
    """Held while this process builds or loads `folder`: an flock, which the kernel releases when
    the holder exits, killed or not. Whoever holds it removes torch's `lock` file if one is there:
    only a builder that died could have left it (the next load rebuilds what it did not finish)."""
    with open(folder / "builder.flock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building Baton's C++ CPU kernels in %s: waiting for it", folder)
            fcntl.flock(f, fcntl.LOCK_EX)
        lock = folder / "lock"
        if lock.exists():
            log.warning("removing the build lock of a build that did not finish (its process is gone): %s", lock)
            lock.unlink(missing_ok=True)
        yield


def loaded_cpu_kernels(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled module for these tensors' elementwise op: only if cpu_kernels() already ran and
    succeeded (never builds), the tensors are float32 or bfloat16 CPU tensors of one dtype, and
    autograd does not need them (the kernels have no backward). Never inside torch.compile: the
    traced torch path is what a compiled (training) layer should fuse, and dynamo cannot trace
    cache_info()."""
    if torch.compiler.is_compiling() or not cpu_kernels.cache_info().currsize:
        return None
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.bfloat16) or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return cpu_kernels()
