"""Tensor- and pipeline-parallel serving: one driver (the engine) and T x P ranks holding shards.

config.py    ParallelConfig (vLLM's names) and the checks that refuse a layout before any process starts
shard.py     shard_model(): a rank's part of the model, cut from outside the shared definition
loader.py    load_shard(): that part read slice by slice from the safetensors files
driver.py    DistributedRunner: the driver's Runner, every step run on all ranks
worker.py    worker_main (every other rank) and what the driver shares with it
tables.py    both KV groups' block tables on their way to the workers, as deltas
comm.py      the shared-memory tensor-parallel group for ranks on one CPU host
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from baton.common.checkpoint import read_config, verify_hashes
from baton.common.errors import UserError
from baton.common.launch import Launch, read_launch
from baton.serve.parallel.config import ParallelConfig
from baton.serve.quantization.config import QuantConfig
from baton.serve.quantization.loader import quantization_config

__all__ = ["ParallelConfig", "check_layout", "launched_rank", "rendezvous", "start_distributed"]


def launched_rank() -> Launch | None:
    """This process's place in a serving job that torchrun or `srun -n N` started (rank 0 serves,
    the others run worker_main); None for a plain process (it spawns its own workers). An srun or
    launcher environment that would not make one job is refused (a UserError, before any process)."""
    launch = read_launch(command="serve")
    return None if launch.source == "single" else launch


def rendezvous(launch: Launch) -> str:
    """The init method for a launched rank: env://, with srun's variables turned into the launcher's
    (MASTER_ADDR = the step's first node, MASTER_PORT derived from the job and step ids)."""
    os.environ.update(launch.env)
    return "env://"


def check_layout(path: str | Path, par: ParallelConfig, device: str, launch: Launch | None = None) -> None:
    """Everything that can be refused before a process starts: sizes, divisibility, devices, and a
    launcher that started another number of processes than tensor x pipeline parallel needs."""
    par.validate()
    cfg = read_config(path)
    raw = quantization_config(path)
    group = None
    if raw is not None:
        q = QuantConfig.from_hf(raw)
        group = q.group_size if q.format == "int4" else None
    par.check_model(cfg, group)
    if launch is not None and launch.world_size != par.world_size:
        raise UserError(
            f"the launcher started {launch.world_size} processes ({launch.source}) but tensor x pipeline "
            f"parallel is {par.tensor_parallel_size} x {par.pipeline_parallel_size} = {par.world_size}: "
            "start one process per rank, with the same -tp/-pp on every one"
        )
    local = launch.local_world_size if launch is not None else par.world_size
    par.check_devices(device, -(-par.world_size // local))


def start_distributed(path: str | Path, config, device: str = "cpu", dtype: torch.dtype | None = None):
    """The driver side: check, spawn (or join) the workers, load every shard; the DistributedRunner."""
    from baton.serve.engine.sizing import kv_group_window
    from baton.serve.parallel.driver import DistributedRunner
    from baton.serve.parallel.worker import KVSizing, Setup

    par = config.parallel
    launch = launched_rank()
    if launch is not None and launch.rank != 0:
        raise UserError(
            f"this process is rank {launch.rank} of a launched job: only rank 0 builds the engine, the "
            "others run worker_main (`baton serve` does this on every rank)"
        )
    check_layout(path, par, device, launch)
    verify_hashes(path)  # once, here; the workers read only their slices
    local = launch.local_world_size if launch is not None else par.world_size
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
        kv_group_window(config, read_config(path)),  # the engine asks the same of the same config
    )
    threads = max(1, (os.cpu_count() or 1) // local)
    setup = Setup(
        str(path), torch.device(device).type, str(dtype).removeprefix("torch.") if dtype else None, par, kv, threads
    )
    if launch is None:
        return DistributedRunner(setup, par)
    return DistributedRunner(setup, par, rendezvous(launch), launch.local_world_size)
