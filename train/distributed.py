"""The process group: who this process is, and the few collectives the training loop needs.

Launchers (torchrun, deepspeed) set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. `srun -n N
baton train` (no launcher) forms one N-rank job from SLURM's variables instead (see read_launch):
without that, srun's N tasks would each train alone into the same out_dir. Without any of them
Baton is one process; DeepSpeed still wants a process group, so a one-rank group is made on a free
loopback port (otherwise DeepSpeed goes looking for mpi4py). CPU uses gloo, CUDA nccl.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from baton.common.errors import UserError

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_PORTS = (10000, 20000)  # derived rendezvous ports: base, span (below Linux's ephemeral range)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

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


@dataclass(frozen=True)
class Launch:
    """Who this process is in its job, from the environment alone (no process group needed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"  # single | launcher (torchrun, deepspeed, or RANK/WORLD_SIZE set) | slurm
    env: dict[str, str] = field(default_factory=dict)  # launcher variables to set (derived from SLURM's)


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The rendezvous port every task of one srun step derives alike, without talking to the others;
    other jobs and steps on the node get other ports. MASTER_PORT overrides it."""
    base, span = SLURM_PORTS
    return base + (job_id + 7919 * step_id) % span


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist, as `scontrol show hostnames` lists it: "gpu[07-09,12],cpu1" -> "gpu07"."""
    entry = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], entry)


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise UserError(f"{key}={env[key]!r} is not an integer") from None


def read_launch(environ: Mapping[str, str] | None = None) -> Launch:
    """This process's rank and world size, from the launcher's variables or SLURM's; raises a
    UserError for a launch that would not make one job (before any process group is made).

    An srun task (SLURM_STEP_ID / SLURM_STEP_NUM_TASKS set) of a step with N > 1 tasks:
    - without launcher variables: rank SLURM_PROCID of SLURM_STEP_NUM_TASKS (else SLURM_NTASKS),
      local rank SLURM_LOCALID, master the first host of SLURM_STEP_NODELIST (else SLURM_NODELIST)
      or MASTER_ADDR, port MASTER_PORT or slurm_port(SLURM_JOB_ID, SLURM_STEP_ID);
    - a torchrun or deepspeed-launcher worker (one launcher per srun task, as launchers/train.sbatch
      does): its WORLD_SIZE must be N x its local world size, else each launcher is its own job;
    - RANK/WORLD_SIZE set by hand (e.g. exported in the batch script): they must be SLURM's.
    A batch script's own process with SLURM_NTASKS > 1 and no launcher is refused: it is one of N
    tasks only under srun.
    """
    env = os.environ if environ is None else environ
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEP_NUM_TASKS" in env
    ntasks_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    tasks = _int(env, ntasks_key) if ntasks_key in env and "SLURM_PROCID" in env else 1
    if "WORLD_SIZE" in env or "RANK" in env:
        world = _int(env, "WORLD_SIZE") if "WORLD_SIZE" in env else 1
        rank = _int(env, "RANK") if "RANK" in env else 0
        if in_step and tasks > 1:
            _check_launcher_under_srun(env, world, rank, tasks, ntasks_key)
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        return Launch(rank, world, local, "launcher")
    if tasks == 1:
        return Launch()
    if not in_step:
        raise UserError(
            f"{ntasks_key}={tasks} but this process is not an srun task (no SLURM_STEP_ID): start the "
            f"{tasks} ranks with `srun baton train ...` or a launcher (launchers/train.sbatch); to train "
            "on this one process, set WORLD_SIZE=1"
        )
    return _from_slurm(env, tasks, ntasks_key)


def _check_launcher_under_srun(env: Mapping[str, str], world: int, rank: int, tasks: int, ntasks_key: str) -> None:
    local_key = next((k for k in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE") if k in env), None)  # torchrun, deepspeed
    if local_key is not None:
        local = _int(env, local_key)
        if world != tasks * local:
            raise UserError(
                f"srun started {tasks} tasks ({ntasks_key}={tasks}), each a launcher of {local} ranks, "
                f"but WORLD_SIZE is {world}, not {tasks} x {local}: each launcher is its own job, and they "
                "would all write into one out_dir. Give the launcher --nnodes (one per srun task) and a "
                "shared rendezvous (launchers/train.sbatch), or drop the launcher and let srun start the "
                "ranks"
            )
        return
    procid = _int(env, "SLURM_PROCID")
    if (rank, world) != (procid, tasks):
        raise UserError(
            f"srun started {tasks} tasks ({ntasks_key}={tasks}; this is SLURM_PROCID={procid}) but "
            f"RANK={env.get('RANK', '(unset)')} and WORLD_SIZE={env.get('WORLD_SIZE', '(unset)')} are set, "
            "which would not make one job of them: unset RANK, WORLD_SIZE and LOCAL_RANK (Baton reads "
            "SLURM's), or start the ranks with a launcher (launchers/train.sbatch)"
        )


def _from_slurm(env: Mapping[str, str], tasks: int, ntasks_key: str) -> Launch:
    need = {"SLURM_PROCID": "this task's rank", "SLURM_LOCALID": "its rank on the node"}
    if "MASTER_PORT" not in env:
        need["SLURM_JOB_ID"] = "for the rendezvous port, or set MASTER_PORT"
    nodelist = next((env[k] for k in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST") if k in env), None)
    if "MASTER_ADDR" not in env and nodelist is None:
        need["SLURM_NODELIST"] = "for the first node, or set MASTER_ADDR"
    missing = [f"{k} ({why})" for k, why in need.items() if k not in env]
    if missing:
        raise UserError(
            f"{ntasks_key}={tasks}: an srun task of a {tasks}-rank job, but {', '.join(missing)} "
            "not set; start it with srun, or with a launcher (launchers/train.sbatch)"
        )
    rank, local = _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID")
    if not 0 <= rank < tasks:
        raise UserError(f"SLURM_PROCID={rank} is not a rank of {ntasks_key}={tasks}")
    step = _int(env, "SLURM_STEP_ID") if env.get("SLURM_STEP_ID", "").isdigit() else 0
    port = env.get("MASTER_PORT") or str(slurm_port(_int(env, "SLURM_JOB_ID"), step))
    addr = env.get("MASTER_ADDR") or first_host(nodelist or "")
    derived = {
        "RANK": str(rank),
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": str(local),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }
    return Launch(rank, tasks, local, "slurm", derived)


def init_distributed(need_group: bool = False) -> Dist:
    """Join the launcher's (or srun's) process group, or make a one-rank one when `need_group`."""
    launch = read_launch()
    world = launch.world_size
    if world == 1 and not need_group:
        return Dist()
    if dist.is_initialized():  # a caller (a test, a notebook) already set one up
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
    rank, local_rank = _int(os.environ, "RANK"), _int(os.environ, "LOCAL_RANK")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(minutes=30))
    # Destroyed at exit, not after train(): DeepSpeed keeps a handle on the group for the life of
    # the process, so a second train() in the same process must find the same group.
    atexit.register(_destroy)
    return Dist(rank, world, local_rank)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
