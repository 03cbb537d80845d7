"""Who this process is in a multi-process job, from the environment alone (no process group).

Shared by `baton train` and `baton serve`: launchers (torchrun, deepspeed) set RANK/WORLD_SIZE/
LOCAL_RANK/MASTER_ADDR/MASTER_PORT; `srun -n N baton ...` without a launcher forms one N-rank job
from SLURM's variables instead (see read_launch) - without that, srun's N tasks would each run
alone. The process group itself is the caller's (train/distributed.py, serve/parallel/).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from baton.common.errors import UserError

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_PORTS = (10000, 20000)  # derived rendezvous ports: base, span (below Linux's ephemeral range)
# What each command's batch launcher is, and what goes wrong when N tasks are not one job.
COMMANDS = {
    "train": ("launchers/train.sbatch", "they would all write into one out_dir"),
    "serve": ("launchers/serve.sbatch", "each would load and serve the model alone"),
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Launch:
    """Who this process is in its job, from the environment alone (no process group needed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"  # single | launcher (torchrun, deepspeed, or RANK/WORLD_SIZE set) | slurm
    env: dict[str, str] = field(default_factory=dict)  # launcher variables to set (derived from SLURM's)
    local_world_size: int = 1  # ranks on this node (they share its devices, cores and memory)


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The rendezvous port every task of one srun step derives alike, without talking to the others;
    other jobs and steps on the node get other ports. MASTER_PORT overrides it."""
    base, span = SLURM_PORTS
    return base + (job_id + 7919 * step_id) % span


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist, as `scontrol show hostnames` lists it: "gpu[07-09,12],cpu1" -> "gpu07"."""
    entry = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], entry)


def tasks_on_node(spec: str, node: int) -> int:
    """The task count of node `node` in a SLURM tasks-per-node list: "2(x3),1" is 2, 2, 2, 1."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise UserError(f"cannot read the SLURM tasks-per-node list {spec!r}")
        counts += [int(m[1])] * int(m[2] or 1)
    if not 0 <= node < len(counts):
        raise UserError(f"SLURM_NODEID={node} is not a node of the tasks-per-node list {spec!r}")
    return counts[node]


def env_int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise UserError(f"{key}={env[key]!r} is not an integer") from None


def read_launch(environ: Mapping[str, str] | None = None, command: str = "train") -> Launch:
    """This process's rank and world size, from the launcher's variables or SLURM's; raises a
    UserError for a launch that would not make one job (before any process group is made).
    `command` (train, serve) only words the messages.

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
    script, harm = COMMANDS[command]
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEP_NUM_TASKS" in env
    ntasks_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    tasks = env_int(env, ntasks_key) if ntasks_key in env and "SLURM_PROCID" in env else 1
    if "WORLD_SIZE" in env or "RANK" in env:
        world = env_int(env, "WORLD_SIZE") if "WORLD_SIZE" in env else 1
        rank = env_int(env, "RANK") if "RANK" in env else 0
        if in_step and tasks > 1:
            _check_launcher_under_srun(env, world, rank, tasks, ntasks_key, script, harm)
        local = env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        local_key = next((k for k in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE") if k in env), None)  # torchrun, deepspeed
        local_world = env_int(env, local_key) if local_key else world
        return Launch(rank, world, local, "launcher", local_world_size=local_world)
    if tasks == 1:
        return Launch()
    if not in_step:
        raise UserError(
            f"{ntasks_key}={tasks} but this process is not an srun task (no SLURM_STEP_ID): start the "
            f"{tasks} ranks with `srun baton {command} ...` or a launcher ({script}); to {command} "
            "on this one process, set WORLD_SIZE=1"
        )
    return _from_slurm(env, tasks, ntasks_key, script)


def _check_launcher_under_srun(
    env: Mapping[str, str], world: int, rank: int, tasks: int, ntasks_key: str, script: str, harm: str
) -> None:
    local_key = next((k for k in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE") if k in env), None)  # torchrun, deepspeed
    if local_key is not None:
        local = env_int(env, local_key)
        if world != tasks * local:
            raise UserError(
                f"srun started {tasks} tasks ({ntasks_key}={tasks}), each a launcher of {local} ranks, "
                f"but WORLD_SIZE is {world}, not {tasks} x {local}: each launcher is its own job, and "
                f"{harm}. Give the launcher --nnodes (one per srun task) and a shared rendezvous "
                f"({script}), or drop the launcher and let srun start the ranks"
            )
        return
    procid = env_int(env, "SLURM_PROCID")
    if (rank, world) != (procid, tasks):
        raise UserError(
            f"srun started {tasks} tasks ({ntasks_key}={tasks}; this is SLURM_PROCID={procid}) but "
            f"RANK={env.get('RANK', '(unset)')} and WORLD_SIZE={env.get('WORLD_SIZE', '(unset)')} are set, "
            "which would not make one job of them: unset RANK, WORLD_SIZE and LOCAL_RANK (Baton reads "
            f"SLURM's), or start the ranks with a launcher ({script})"
        )


def _from_slurm(env: Mapping[str, str], tasks: int, ntasks_key: str, script: str) -> Launch:
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
            f"not set; start it with srun, or with a launcher ({script})"
        )
    rank, local = env_int(env, "SLURM_PROCID"), env_int(env, "SLURM_LOCALID")
    if not 0 <= rank < tasks:
        raise UserError(f"SLURM_PROCID={rank} is not a rank of {ntasks_key}={tasks}")
    step = env_int(env, "SLURM_STEP_ID") if env.get("SLURM_STEP_ID", "").isdigit() else 0
    port = env.get("MASTER_PORT") or str(slurm_port(env_int(env, "SLURM_JOB_ID"), step))
    addr = env.get("MASTER_ADDR") or first_host(nodelist or "")
    derived = {
        "RANK": str(rank),
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": str(local),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }
    per_node = next((env[k] for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if k in env), None)
    node = env_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    local_world = tasks_on_node(per_node, node) if per_node else tasks
    return Launch(rank, tasks, local, "slurm", derived, local_world)
