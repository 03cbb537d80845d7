"""A training checkpoint of any backend as the universal state (baton.train.universal): whole
tensors by parameter name, for a resume at another layout or backend and for `baton export`."""

from __future__ import annotations

from pathlib import Path

from baton.train.universal import UniversalState, read_universal


def read_any(directory: Path, backend: str, with_optimizer: bool = True) -> UniversalState:
    """The universal state of a training checkpoint written by `backend` (its layout's backend):
    ZeRO shards and torch3d's DCP files are consolidated; the plain backend (and megatron, for its
    weights) wrote the universal files themselves."""
    if backend == "deepspeed":
        from baton.train.backends.zero_checkpoint import read_zero_checkpoint

        return read_zero_checkpoint(directory, with_optimizer)
    if backend == "torch3d":
        from baton.train.parallel.checkpoint import DCP_DIR, read_dcp

        return read_dcp(directory / DCP_DIR, with_optimizer)
    return read_universal(directory, with_optimizer)
