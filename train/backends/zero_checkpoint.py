"""Baton's own conversion of DeepSpeed ZeRO checkpoints into the universal training state.

DeepSpeed can only resume a ZeRO checkpoint at the world size that wrote it; its ds_to_universal
tool covers ZeRO-3 but not ZeRO-1/2. Here every stage is read back into whole, named fp32
tensors (weights and both Adam moments), from which any layout can be loaded again.

On-disk layout (DeepSpeed 0.19, the pinned range), one file per rank:
- stage 0: one `mp_rank_00_model_states.pt` with the module and a plain torch optimizer state;
  under bf16/fp16 the module is in that dtype and the optimizer entry is FP16_UnfusedOptimizer's,
  with the float32 master copies (`fp32_groups`) and the AdamW state inside it.
- stage 1-3 under bf16 name their optimizer files `bf16_zero_pp_rank_*`; the flat groups hold
  float32 masters at every precision.
- stage 1/2: each rank holds a contiguous slice of every parameter group flattened (params in
  group order, each followed by its alignment padding); `single_partition_of_fp32_groups[g]`
  and the base optimizer's state[g] are that slice.
- stage 3: each parameter is split into world_size equal pieces (the last one padded); a rank's
  flat groups hold its piece of every parameter, back to back. Under NVMe offload the swapped
  groups are missing from DeepSpeed's files; Baton writes them per rank (NVME_STATE) instead.
The model states file holds the module's persistent buffers whole (DeepSeek-V3's correction biases,
named in its `buffer_names`): they join the weights.
These files are DeepSpeed's pickles written by this training run: the only thing Baton unpickles.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from baton.train.universal import MOMENTS, UniversalState
from safetensors import safe_open

TAG = "zero"  # DeepSpeed's checkpoint tag inside a Baton step directory
GROUPS_FILE = "param_groups.json"  # parameter names per optimizer group (stage 0 needs them)
NVME_STATE = "nvme_state_rank{rank}.safetensors"  # Baton's copy of NVMe-swapped ZeRO-3 state, per rank


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def _rank_of(path: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", path.name).group(1))


def read_zero_checkpoint(directory: Path, with_optimizer: bool = True) -> UniversalState:
    """The universal state of a Baton DeepSpeed checkpoint directory (any stage, any world size)."""
    tag = directory / TAG
    optim_files = sorted(tag.glob("*zero_pp_rank_*_optim_states.pt"), key=_rank_of)
    if not optim_files:
        return _read_stage0(tag, json.loads((directory / GROUPS_FILE).read_text()), with_optimizer)
    shards = [_load(f)["optimizer_state_dict"] for f in optim_files]
    if (tag / NVME_STATE.format(rank=0)).is_file():
        shards = [_nvme_shard(tag / NVME_STATE.format(rank=r)) for r in range(len(shards))]
    if len(shards) != [_rank_of(f) for f in optim_files][-1] + 1:
        raise ValueError(f"{tag}: optimizer shards of some ranks are missing")
    model_states = _load(next(iter(sorted(tag.glob("*model_states.pt")))))
    shapes: list[dict[str, torch.Size]] = model_states["param_shapes"]
    stage = int(shards[0]["zero_stage"])
    merge = _merge_stage3 if stage == 3 else _merge_stage12
    fp32_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    base_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
    weights = merge(shards, shapes, lambda sh, g: sh[fp32_key][g]) | _buffers(model_states)
    if not with_optimizer:
        return UniversalState(weights, {}, {}, 0)
    moments = {key: merge(shards, shapes, lambda sh, g, key=key: sh[base_key]["state"][g][key]) for key in MOMENTS}
    step = int(shards[0][base_key]["state"][0]["step"])
    return UniversalState(weights, moments["exp_avg"], moments["exp_avg_sq"], step)


def _buffers(model_states: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The module's persistent buffers, whole, from a model states file."""
    return {n: model_states["module"][n].clone() for n in model_states.get("buffer_names", [])}


def _nvme_shard(path: Path) -> dict[str, Any]:
    """A rank's NVMe state file in the shape of a ZeRO-3 optimizer shard."""
    with safe_open(path, framework="pt") as f:
        step = int(f.metadata()["step"])
        flat = {k: f.get_tensor(k) for k in f.keys()}
    groups = range(sum(k.startswith("fp32/") for k in flat))
    state = {g: {"step": step, **{key: flat[f"{key}/{g}"] for key in MOMENTS}} for g in groups}
    return {
        "zero_stage": 3,
        "fp32_flat_groups": [flat[f"fp32/{g}"] for g in groups],
        "optimizer_state_dict": {"state": state},
    }


def _read_stage0(tag: Path, group_names: list[list[str]], with_optimizer: bool) -> UniversalState:
    sd = _load(tag / "mp_rank_00_model_states.pt")
    names = [n for group in group_names for n in group]
    opt = sd["optimizer"]
    if "fp32_groups" in opt:  # bf16/fp16: DeepSpeed's FP16_UnfusedOptimizer around the AdamW
        masters = [t for group in opt["fp32_groups"] for t in group]
        weights = {n: t.float().clone() for n, t in zip(names, masters, strict=True)}
        opt = opt["optimizer_state_dict"]
    else:
        weights = {n: sd["module"][n].float().clone() for n in names}
    weights |= _buffers(sd)
    if not with_optimizer:
        return UniversalState(weights, {}, {}, 0)
    index = [i for g in opt["param_groups"] for i in g["params"]]  # state keys, in group order
    moments = {key: {n: opt["state"][i][key].clone() for n, i in zip(names, index)} for key in MOMENTS}
    step = int(opt["state"][index[0]]["step"])
    return UniversalState(weights, moments["exp_avg"], moments["exp_avg_sq"], step)


Flat = Callable[[dict[str, Any], int], torch.Tensor]


def _merge_stage12(shards: list[dict], shapes: list[dict[str, torch.Size]], flat: Flat) -> dict[str, torch.Tensor]:
    out = {}
    paddings = shards[0].get("param_alignment_paddings")
    for g, group in enumerate(shapes):
        full = torch.cat([flat(sh, g).detach().cpu().float() for sh in shards])
        pads = paddings[g] if paddings else [0] * len(group)
        offset = 0
        for (name, shape), pad in zip(group.items(), pads):
            n = math.prod(shape)
            out[name] = full.narrow(0, offset, n).view(shape).clone()
            offset += n + pad
        if offset > full.numel():
            raise ValueError(f"ZeRO group {g}: parameters need {offset} elements, the shards hold {full.numel()}")
    return out


def _merge_stage3(shards: list[dict], shapes: list[dict[str, torch.Size]], flat: Flat) -> dict[str, torch.Tensor]:
    world = len(shards)
    groups = len(shards[0]["fp32_flat_groups"])
    per_rank = [torch.cat([flat(sh, g).detach().cpu().float() for g in range(groups)]) for sh in shards]
    out, offset = {}, 0
    for name, shape in ((n, s) for group in shapes for n, s in group.items()):
        n = math.prod(shape)
        piece = math.ceil(n / world)
        out[name] = torch.cat([r.narrow(0, offset, piece) for r in per_rank])[:n].view(shape).clone()
        offset += piece
    if offset != per_rank[0].numel():
        raise ValueError(f"ZeRO-3 shards hold {per_rank[0].numel()} elements per rank, parameters need {offset}")
    return out
