"""Data parallelism over dp x cp, applied last: FSDP2 (fully_shard) or DDP.

FSDP2 shards every parameter (tensor-parallel DTensors included, giving 2D dp x tp shards) over
the data mesh, one unit per decoder layer plus the chunk itself (embedding, norm, head), so only
one layer is gathered at a time. Under pipelining the parameters stay gathered between micro-
batches (reshard_after_forward=False), trading memory for not re-gathering every micro-batch.
DDP keeps a full replica per rank and all-reduces gradients; it cannot hold DTensor parameters.
Mixed precision under FSDP2 is its MixedPrecisionPolicy (`param_dtype`): the sharded float32
parameters are the optimizer's master weights, each layer is gathered in the compute dtype and
runs in it, and gradients are reduce-scattered in float32. (DDP runs under autocast instead.)
"""

from __future__ import annotations

import torch
from baton.train.parallel.pipeline import ModelChunk
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel


def apply_fsdp(
    chunks: list[ModelChunk], mesh: DeviceMesh, pipelined: bool, param_dtype: torch.dtype | None = None
) -> list[nn.Module]:
    """`param_dtype`: the compute dtype (None: the parameters' own, float32)."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for chunk in chunks:
        for layer in chunk.model.layers.values():
            fully_shard(layer, mesh=mesh, reshard_after_forward=not pipelined, mp_policy=policy)
        fully_shard(chunk, mesh=mesh, reshard_after_forward=not pipelined, mp_policy=policy)
    return list(chunks)


def apply_ddp(chunks: list[ModelChunk], mesh: DeviceMesh) -> list[nn.Module]:
    """The DDP wrappers to run (the chunks themselves keep the parameter names). On CUDA each
    chunk already sits on the rank's GPU, which DDP is told (device_ids), as it expects."""
    wrappers = []
    for c in chunks:
        device = next(c.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        wrappers.append(DistributedDataParallel(c, device_ids=ids, process_group=mesh.get_group()))
    return wrappers
