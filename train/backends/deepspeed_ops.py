"""DeepSpeed's JIT-built ops (cpu_adam, async_io, pin_memory, shm comm): built once per machine and
installation, not once per checkout.

DeepSpeed builds them with torch's JIT builder into TORCH_EXTENSIONS_DIR/<op>, which reruns ninja on
every load; ninja rebuilds when the compile command or a source's mtime changed. Each checkout or
virtualenv has its own copy of DeepSpeed's sources (other paths, the mtimes of its install), so two
of them on one machine rebuilt the shared folder over each other's build at every switch: minutes
per op (async_io ~3 min, cpu_adam ~1 min on 2 cores). Here a build lives in a folder named after
what its library depends on (DeepSpeed, torch and Python versions, accelerator, CPU features) and
is marked with a digest of its sources once it loaded; a later process of that key imports the
library directly, whichever copy of the same sources it runs from.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

MARKER = "baton-sources.sha1"


def build_root(root: Path) -> Path:
    """The folder under `root` (TORCH_EXTENSIONS_DIR's role) for this installation's op builds."""
    from deepspeed.accelerator import get_accelerator

    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    cpu = hashlib.sha1(flags.encode()).hexdigest()[:8]  # the ops are built with -march=native
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return root / f"deepspeed{version('deepspeed')}-torch{torch.__version__}-{py}-{get_accelerator()._name}-cpu{cpu}"


def sources_digest(builder: Any) -> str:
    h = hashlib.sha1(builder.name.encode())
    for s in builder.sources():
        h.update(Path(builder.deepspeed_src_path(s)).read_bytes())
    return h.hexdigest()


@contextlib.contextmanager
def _extensions_dir(folder: Path) -> Iterator[None]:
    """torch's builder takes its folder only from this variable (DeepSpeed passes none)."""
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = before


def use_build_cache(root: Path) -> Path:
    """Route every JIT load of a DeepSpeed op in this process through the cache under `root`
    (idempotent); returns the folder the builds go to."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    folder = build_root(root)
    jit_load = getattr(OpBuilder.jit_load, "baton_original", OpBuilder.jit_load)

    def cached_jit_load(self: Any, verbose: bool = True) -> ModuleType:
        lib, marker = folder / self.name / f"{self.name}.so", folder / self.name / MARKER
        digest = sources_digest(self)
        if lib.is_file() and marker.is_file() and marker.read_text() == digest:
            spec = importlib.util.spec_from_file_location(self.name, lib)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            OpBuilder._loaded_ops[self.name] = module  # where load() looks first, as after a JIT build
            return module
        with _extensions_dir(folder):
            module = jit_load(self, verbose)
        marker.write_text(digest)
        return module

    cached_jit_load.baton_original = jit_load
    OpBuilder.jit_load = cached_jit_load
    return folder
