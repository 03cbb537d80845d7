"""Where a DeepSpeed rank keeps its model state, in bytes, by kind and by location.

Parameters, fp32 master copies and optimizer moments are counted from the live tensors (at
ZeRO-3 from the partition sizes, since NVMe-swapped tensors are empty in memory). Gradients
are transient (alive between backward and step), so they are given by ZeRO's accounting: whole on
every rank at stage 0/1, a 1/N partition at stage 2/3. "accelerator" is where the tensors would sit
on a GPU; on a CPU-only machine that is host memory too, so offload moves bytes between columns
here without lowering RSS. Under bf16/fp16 the module's parameters and gradients take 2 bytes each;
the float32 masters (at stage 0 FP16_UnfusedOptimizer's whole copy) and the moments take 4.
"""

from __future__ import annotations

from typing import Any

import torch


def _numel(tensors) -> int:
    return sum(t.numel() for t in tensors if torch.is_tensor(t))


def zero_memory(backend: Any) -> dict[str, Any]:
    engine, stage, dp = backend.engine, backend.stage, backend.dist.world_size
    params = list(engine.module.parameters())
    full = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)
    if stage == 3:  # each rank holds its partition; small "persistent" parameters stay whole
        held = sum(p.numel() if getattr(p, "ds_persist", False) else p.ds_tensor.numel() for p in params)
    else:
        held = full
    low = backend.layout.precision != "fp32"
    opt = engine.optimizer
    base = opt.optimizer if stage > 0 or low else opt
    moments = _numel(t for st in base.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    if stage == 3:  # sized from the partitions: under NVMe offload the tensors in memory are empty
        master = sum(opt.fp16_partitioned_groups_flat_numel)
        moments = 2 * master if base.state else 0
    elif stage > 0:
        master = _numel(opt.single_partition_of_fp32_groups)
    else:
        master = full if low else 0
    grads = full if stage < 2 else -(-full // dp)
    width = params[0].element_size() if params else 4  # the module's dtype: its parameters and gradients
    d = backend.layout
    where_opt = {"none": "accelerator", "cpu": "host", "nvme": "nvme"}[d.offload_optimizer]
    where_param = {"none": "accelerator", "cpu": "host", "nvme": "nvme"}[d.offload_param]
    out: dict[str, Any] = {"accelerator": {}, "host": {}, "nvme": {}}
    out[where_param]["params"] = held * width
    # Offloaded ZeRO-1/2 (and 3) reduce gradient partitions into float32 host buffers for the host-side step.
    offloaded = stage > 0 and d.offload_optimizer != "none"
    out[where_opt if offloaded else "accelerator"]["grads"] = grads * (4 if offloaded else width)
    out[where_opt]["optimizer"] = moments * 4
    out[where_opt]["master_params"] = master * 4
    out["parameters"] = full
    return out
