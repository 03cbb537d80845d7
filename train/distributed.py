"""The process group: who this process is, and the few collectives the training loop needs.

Launchers (torchrun, deepspeed) set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. `srun -n N
baton train` (no launcher) forms one N-rank job from SLURM's variables instead (read_launch, in
baton.common.launch, shared with `baton serve`): without that, srun's N tasks would each train
alone into the same out_dir. Without any of them Baton is one process; DeepSpeed still wants a
process group, so a one-rank group is made on a free loopback port (otherwise DeepSpeed goes looking for mpi4py). CPU uses gloo, CUDA nccl.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from baton.common.errors import UserError
from baton.common.launch import LAUNCHER_VARS, env_int, free_port, read_launch

__all__ = ["Dist", "free_port", "init_distributed", "rank_device", "read_launch"]


def rank_device(local_rank: int = 0) -> torch.device:
    """The device a rank computes on: cuda:LOCAL_RANK where CUDA is available, else the CPU."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """NCCL for CUDA ranks, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return rank_device(self.local_rank)

    @property
    def active(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.active and self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def broadcast_object(self, obj: Any) -> Any:
        """rank 0's `obj` on every rank."""
        if not (self.active and self.world_size > 1):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not (self.active and self.world_size > 1):
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def init_distributed(need_group: bool = False) -> Dist:
    """Join the launcher's (or srun's) process group, or make a one-rank one when `need_group`."""
    launch = read_launch()
    world = launch.world_size
    if world == 1 and not need_group:
        return Dist()
    if dist.is_initialized():  # a caller (a test, a notebook) already set one up
        _use_device(rank_device(launch.local_rank))
        return Dist(dist.get_rank(), dist.get_world_size(), launch.local_rank)
    os.environ.update(launch.env)  # srun's ranks as launcher variables: DeepSpeed and torch read those
    if world == 1:
        for key, value in (
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", str(free_port())),
        ):
            os.environ.setdefault(key, value)
    missing = [k for k in LAUNCHER_VARS if k not in os.environ]
    if missing:
        raise UserError(
            f"WORLD_SIZE={world} but {', '.join(missing)} not set: start with launchers/torchrun.sh "
            "or launchers/deepspeed.sh"
        )
    rank, local_rank = env_int(os.environ, "RANK"), env_int(os.environ, "LOCAL_RANK")
    device = rank_device(local_rank)
    _use_device(device)
    dist.init_process_group(process_group_backend(device), rank=rank, world_size=world, timeout=timedelta(minutes=30))
    # Destroyed at exit, not after train(): DeepSpeed keeps a handle on the group for the life of
    # the process, so a second train() in the same process must find the same group.
    atexit.register(_destroy)
    return Dist(rank, world, local_rank)


def _use_device(device: torch.device) -> None:
    """Make `device` current, so library code that asks for "the" CUDA device gets this rank's."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
