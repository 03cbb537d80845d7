"""A checkpoint's tensors read by name, whole or one slice, straight from its safetensors files.

Sharded loaders (the trainer's `init_from`, the server's tensor/pipeline-parallel workers) build the
model on the meta device and read only the rows/columns a rank keeps: safetensors' get_slice
copies just those bytes out of the memory-mapped file. Each read opens the file afresh and closes
it, so the mapping's touched pages (which count towards a process's resident memory) are released
after every tensor instead of piling up to the whole file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from baton.common.checkpoint import CheckpointError, weight_files
from safetensors import safe_open


class WeightSlices:
    """The tensors of a checkpoint directory (one file, or shards + index), by name."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.files: dict[str, Path] = {}
        for f in weight_files(self.directory):
            if not f.is_file():
                raise CheckpointError(f"weight shard {f.name} listed in the index is missing from {directory}")
            with safe_open(f, framework="pt") as h:
                self.files.update(dict.fromkeys(h.keys(), f))

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _file(self, name: str) -> Path:
        if name not in self.files:
            raise CheckpointError(f"{self.directory} has no tensor {name!r}")
        return self.files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(self._file(name), framework="pt") as h:
            return tuple(h.get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor `name`, or only `index` of it (one slice per leading dimension; the rest whole)."""
        with safe_open(self._file(name), framework="pt") as h:
            if index is None:
                return h.get_tensor(name)
            return h.get_slice(name)[index]
