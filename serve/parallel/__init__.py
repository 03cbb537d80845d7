"""Tensor- and pipeline-parallel serving: one driver (the engine) and T x P ranks holding shards.

config.py    ParallelConfig (vLLM's names) and the checks that refuse a layout before any process starts
shard.py     shard_model(): a rank's part of the model, cut from outside the shared definition
loader.py    load_shard(): that part read slice by slice from the safetensors files
executor.py  DistributedRunner (the driver's model runner) and worker_main (every other rank)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from baton.common.checkpoint import read_config, verify_hashes
from baton.serve.parallel.config import ParallelConfig
from baton.serve.quantization.config import QuantConfig
from baton.serve.quantization.loader import quantization_config

__all__ = ["ParallelConfig", "start_distributed", "launched_rank"]


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when a launcher (torchrun, or srun via its variables) started this process
    as one rank of a serving job; None for a plain process (it spawns its own workers)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def check_layout(path: str | Path, par: ParallelConfig, device: str) -> None:
    """Everything that can be refused before a process starts: sizes, divisibility, devices."""
    par.validate()
    cfg = read_config(path)
    raw = quantization_config(path)
    group = None
    if raw is not None:
        q = QuantConfig.from_hf(raw)
        group = q.group_size if q.format == "int4" else None
    par.check_model(cfg, group)
    launched = launched_rank()
    nnodes = int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("SLURM_NNODES", 1))) if launched else 1
    if launched and launched[1] != par.world_size:
        raise ValueError(
            f"the launcher started {launched[1]} processes but tensor x pipeline parallel is {par.world_size}"
        )
    par.check_devices(device, nnodes)


def start_distributed(path: str | Path, config, device: str = "cpu", dtype: torch.dtype | None = None):
    """The driver side: check, spawn (or join) the workers, load every shard; the DistributedRunner."""
    from baton.serve.parallel.executor import DistributedRunner, KVSizing, Setup

    par = config.parallel
    check_layout(path, par, device)
    verify_hashes(path)  # once, here; the workers read only their slices
    launched = launched_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", par.world_size)) if launched else par.world_size
    swap = config.scheduler.preemption_mode == "swap"
    kv = KVSizing(
        config.block_size,
        config.kv_cache_dtype,
        config.num_kv_blocks,
        config.kv_cache_bytes,
        config.kv_cache_fraction,
        config.gpu_memory_utilization,
        config.swap_space_bytes if swap else 0,
        config.scheduler.max_num_batched_tokens,
        config.scheduler.max_num_seqs,
    )
    threads = max(1, (os.cpu_count() or 1) // local)
    setup = Setup(
        str(path), torch.device(device).type, str(dtype).removeprefix("torch.") if dtype else None, par, kv, threads
    )
    return DistributedRunner(path, setup, par, init_method="env://" if launched else None)
