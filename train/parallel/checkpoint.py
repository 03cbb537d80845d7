"""Layout-free checkpoints through torch.distributed.checkpoint (DCP).

Every rank writes only its own shards, but under the model's full parameter names and global
shapes ("model.<fqn>", and AdamW state flattened per name: "optim.state.<fqn>.exp_avg", ...).
Loading plans the reads from the target layout's shards, so a run saved at one dp x pp x cp x tp
resumes at any other (or on one process, or is consolidated for export) with no conversion step.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from baton.train.parallel.parallelize import Parallel3D
from baton.train.universal import UniversalState
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

DCP_DIR = "dcp"  # the shards, inside backend torch3d's step checkpoint directory
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
MOMENTS = ("exp_avg", "exp_avg_sq")


def _state(engine: Parallel3D) -> tuple[dict, list[tuple[dict, dict]]]:
    """The DCP state dict of this rank, and each chunk's (model, optimizer) parts of it."""
    parts = [
        (get_model_state_dict(c), get_optimizer_state_dict(c, o, options=FLAT))
        for c, o in zip(engine.chunks, engine.optimizers)
    ]
    merged = {
        "model": {k: v for m, _ in parts for k, v in m.items()},
        "optim": {k: v for _, o in parts for k, v in o.items()},
    }
    return merged, parts


def save(engine: Parallel3D, directory: str | Path) -> None:
    """Collective: every rank writes its shards into `directory` (shared by all ranks)."""
    dcp.save(_state(engine)[0], checkpoint_id=str(directory))


def load(engine: Parallel3D, directory: str | Path) -> None:
    """Collective: fill this layout's shards (model and optimizer) from a checkpoint of any layout."""
    merged, parts = _state(engine)  # a fresh optimizer gets zero state first, so there is a tensor to read into
    dcp.load(merged, checkpoint_id=str(directory))
    for (model_sd, optim_sd), chunk, opt in zip(parts, engine.chunks, engine.optimizers):
        set_model_state_dict(chunk, {k: merged["model"][k] for k in model_sd})
        set_optimizer_state_dict(chunk, opt, {k: merged["optim"][k] for k in optim_sd}, options=FLAT)


def read_dcp(directory: str | Path, with_optimizer: bool = True) -> UniversalState:
    """Whole tensors by parameter name, on one process without a process group (export, or a
    resume with the plain-PyTorch backend)."""
    reader = FileSystemReader(str(directory))
    meta = reader.read_metadata().state_dict_metadata
    wanted = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
        and (k.startswith("model.") or (with_optimizer and k.startswith("optim.state.")))
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    weights = {k.removeprefix("model."): t for k, t in wanted.items() if k.startswith("model.")}
    moments: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MOMENTS}
    step = 0
    for key, t in wanted.items():
        if not key.startswith("optim.state."):
            continue
        name, kind = key.removeprefix("optim.state.").rsplit(".", 1)
        if kind in moments:
            moments[kind][name] = t
        elif kind == "step":
            step = int(t.item())
    return UniversalState(weights, moments["exp_avg"], moments["exp_avg_sq"], step)
