"""Builds (once per machine, with torch's JIT extension builder) and loads Baton's C++ CPU kernels.

Only paged decode attention has one: on CPU the torch path gathers every sequence's K/V blocks into
a padded copy before SDPA, and that copy, not the arithmetic, is most of a decode step's attention
time. The C++ kernel reads the pools in place (csrc/paged_decode_cpu.cpp). Without a C++ compiler
the build fails once, a warning says so, and the torch path is used; BATON_CPU_KERNELS=0 skips it.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).resolve().parent / "csrc" / "paged_decode_cpu.cpp"]
# -march=native: the build is per machine (torch caches it under ~/.cache/torch_extensions);
# -fopenmp: at::parallel_for splits the work between torch's threads only when OpenMP is on.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None (disabled, or the build failed: then the torch paths run)."""
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        return None
    from torch.utils.cpp_extension import load

    log.info("loading Baton's C++ CPU kernels (the first time on a machine builds them: ~20 s)")
    try:
        return load("baton_cpu_kernels", [str(s) for s in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja, a failed build: fall back, say so once
        log.warning("could not build Baton's C++ CPU kernels (%s: %s); using the slower torch paths",
                    type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
