"""backend megatron's checkpoints: megatron's dist_checkpointing, fully reshardable, plus the
whole Baton weights for the handoff.

`megatron/` holds the model and optimizer as megatron writes them (the distributed optimizer in
its `fully_reshardable` form: the default `fully_sharded_model_space` fails at save), so a run
resumes at any tp x pp x dp and virtual pipeline size. `model.safetensors` holds the whole weights
under Baton's names (megatron_layout.megatron_to_baton), which is what `baton export` and the
handoff read (baton.train.universal), so a Megatron run reaches the server like any other.

Two upstream traps are handled on load, each with a test in tests/train/test_megatron.py: a fresh
optimizer has no state to load into until its states are initialised, and megatron restores one
`step` tensor shared by every parameter, which each AdamW step would then advance once per
parameter.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as tdist
from baton.common.config import ConfigError
from baton.common.megatron_layout import megatron_to_baton
from baton.train.backends.base import Layout
from baton.train.universal import WEIGHTS_FILE
from safetensors.torch import save_file

MEGATRON_DIR = "megatron"
LAYOUT_FILE = "parallel_layout.json"
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded(backend, is_loading: bool) -> dict:
    """The sharded state dict of this rank's model chunks and optimizer (collective)."""
    sd = {f"model{v}": c.module.sharded_state_dict() for v, c in enumerate(backend.chunks)}
    if is_loading:
        init_optimizer_states(backend.optimizer)
    sd["optimizer"] = backend.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=SHARDING)
    return sd


def save(backend, directory: Path) -> None:
    """Collective: every rank writes its shards; rank 0 the whole Baton weights too."""
    from megatron.core import dist_checkpointing

    target = directory / MEGATRON_DIR
    if backend.dist.is_main:
        target.mkdir(parents=True, exist_ok=True)
    backend.dist.barrier()
    dist_checkpointing.save(_sharded(backend, is_loading=False), str(target))
    weights = whole_weights(backend)
    if backend.dist.is_main:
        save_file(weights, directory / WEIGHTS_FILE, metadata={"format": "pt"})
        m = backend.m  # the layout the handoff's metadata reports (as torch3d's parallel_layout.json)
        layout = {
            "dp": backend.dp,
            "pp": m.pp,
            "cp": 1,
            "tp": m.tp,
            "vp": m.vp,
            "sequence_parallel": m.sequence_parallel,
        }
        (directory / LAYOUT_FILE).write_text(json.dumps(layout, indent=2) + "\n")


def load(backend, directory: Path, saved: Layout) -> None:
    """Collective: restore model and optimizer from a megatron checkpoint of any layout."""
    from megatron.core import dist_checkpointing

    if saved.backend != "megatron" or not (directory / MEGATRON_DIR).is_dir():
        raise ConfigError(
            f"{directory} was written by backend {saved.backend!r}; backend megatron resumes only its own "
            "checkpoints (at any layout). Resume it with its own backend, or `baton export` it and start a new run"
        )
    state = dist_checkpointing.load(_sharded(backend, is_loading=True), str(directory / MEGATRON_DIR))
    for v, c in enumerate(backend.chunks):
        c.module.load_state_dict(state[f"model{v}"])
    with _steps_loaded_apart():
        backend.optimizer.load_state_dict(state["optimizer"])
    separate_steps(backend.optimizer)


@contextlib.contextmanager
def _steps_loaded_apart() -> Iterator[None]:
    """DistributedOptimizer._set_main_param_and_optimizer_states copies every key of a parameter's
    state from the checkpoint, but load_parameter_state_from_fully_reshardable leaves torch
    AdamW's `step` out of it (restored from the param groups instead): KeyError 'step'. While the
    distributed optimizer loads, only the keys the checkpoint has are copied."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key, src in tensors.items():
            dst[key].copy_(src)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def init_optimizer_states(optimizer) -> None:
    """Give every parameter of a fresh optimizer its AdamW state (zero moments, step 0), as a first
    step would: megatron's sharded_state_dict reads each state's `step` (KeyError on a fresh one;
    its own init_state_fn makes only the moments), and the load fills these tensors in place."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = o.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {
                        "step": torch.zeros((), dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }


def separate_steps(optimizer) -> None:
    """One `step` tensor per parameter: megatron restores a single shared one, and AdamW's
    in-place `step += 1` would then count every parameter's step on it."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for st in o.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()


def whole_weights(backend) -> dict[str, torch.Tensor]:
    """Collective: the whole model under Baton's names on rank 0 (empty elsewhere), from the chunks
    of the data-parallel rank 0 replica."""
    from megatron.core import parallel_state as ps

    mine = {}
    if ps.get_data_parallel_rank() == 0:
        tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        for v, c in enumerate(backend.chunks):
            sd = {k: t.detach().cpu().float() for k, t in c.module.state_dict().items() if torch.is_tensor(t)}
            mine[(tp, pp, v)] = {k: t for k, t in sd.items() if not k.endswith("_extra_state")}
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        parts = [mine]
    else:
        parts = [None] * tdist.get_world_size() if backend.dist.is_main else None
        tdist.gather_object(mine, parts, dst=0)
    if not backend.dist.is_main:
        return {}
    shards = {k: sd for part in parts for k, sd in part.items()}
    return megatron_to_baton(shards, backend.mc, spec=backend.spec)
