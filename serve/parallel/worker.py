"""A worker rank of a sharded model, and what the driver shares with it (vLLM's worker).

Rank r is tensor rank r % T of pipeline stage r // T; rank 0 is the driver (serve/parallel/driver.py:
it keeps the scheduler, block manager and sampler, and is also stage 0's first tensor rank). Every
step it broadcasts one small command over a CPU (gloo) group - the StepPlan's token ids,
positions, slot mapping and block tables, or the step's block copies - and every rank turns it
into tensors on its own device (serve_commands here). Activations travel on the device group
(gloo on CPU, NCCL on CUDA): the tensor-parallel all-reduces inside the layers, the hidden states
between pipeline stages (run_stage), and the sampled rows' logits from the last stage back to the
driver.

Pipeline parallelism splits each step's sequences into P micro-batches that follow each other
through the stages (stage s works on micro-batch m while stage s+1 works on m-1), so the stages
overlap within a step.

Locally the workers are spawned by the driver (multiprocessing, spawn); across nodes they are
started by torchrun or srun running `baton serve` with the same arguments, and join the driver's
rendezvous (env://, from baton.common.launch). A launched worker exits when the driver does, or
after distributed_timeout_s without a command. Workers ignore SIGTERM/SIGINT: the driver drains
first, then stops them.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from baton.common.checkpoint import read_config
from baton.serve.core.faults import EngineFault
from baton.serve.engine.sizing import Pools, group_split, window_demand
from baton.serve.parallel.comm import ShmGroup, shared_memory_usable
from baton.serve.parallel.config import ParallelConfig
from baton.serve.parallel.loader import load_shard, weight_bytes
from baton.serve.parallel.shard import Shard
from baton.serve.parallel.tables import GroupTableReceiver
from baton.serve.runner.kv_budget import kv_budget_bytes
from baton.serve.runner.late_entry import LateEntries, install_late_entry
from baton.serve.runner.model_runner import ModelRunner, kv_block_bytes
from baton.serve.runner.step_plan import StepPlan

log = logging.getLogger(__name__)
# A spawned worker starts a Python and imports torch before it can join (seconds on a busy host):
# it gets this long even when distributed_timeout_s (a collective's bound) is set lower.
SPAWN_S = 120.0


class WorkerLost(EngineFault):
    """A worker rank died, hung or failed: the sharded model cannot run any more."""


@dataclass
class KVSizing:
    """What each rank needs to size its pools; every rank computes its capacity, the smallest wins."""

    block_size: int
    kv_cache_dtype: str
    num_kv_blocks: int | None
    kv_cache_bytes: int | None  # per rank
    kv_cache_fraction: float
    gpu_memory_utilization: float
    swap_space_bytes: int  # per rank; 0 without swap preemption
    max_num_batched_tokens: int
    max_num_seqs: int
    window: int | None = None  # KV groups (kv_group_window's): the sliding layers' pool of their own


@dataclass
class Setup:
    """The driver's first broadcast: everything a worker needs to build its shard."""

    model_dir: str
    device_type: str
    dtype: str | None
    parallel: ParallelConfig
    kv: KVSizing
    threads: int


@dataclass
class Topology:
    rank: int
    world: int
    tp: int
    pp: int
    local_rank: int  # on this node: its device index
    local_world: int  # ranks on this node: they share its memory
    tp_group: object = None
    cpu_group: object = None
    stats: dict = field(default_factory=dict)
    moe_parallel: str = "tensor"  # the MoE split this model uses (ParallelConfig.moe_mode), set by build_runner

    @property
    def shard(self) -> Shard:
        return Shard(self.rank % self.tp, self.tp, self.rank // self.tp, self.pp, self.moe_parallel)

    @property
    def last_rank(self) -> int:  # the last stage's first tensor rank: it sends logits to the driver
        return (self.pp - 1) * self.tp


Rendezvous = str | tuple[str, int]  # "env://" (torchrun/srun), or the driver's TCPStore (host, port)


def _connect(rendezvous: Rendezvous, world: int, timeout: timedelta) -> dist.Store | None:
    if isinstance(rendezvous, str):
        return None
    host, port = rendezvous
    return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)


def init_groups(
    rank: int,
    world: int,
    par: ParallelConfig,
    device_type: str,
    rendezvous: Rendezvous | dist.Store,
    local: tuple[int, int],
) -> Topology:
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=par.distributed_timeout_s)
    if isinstance(rendezvous, str):
        dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, store=rendezvous, rank=rank, world_size=world, timeout=timeout)
    topo = Topology(rank, world, par.tensor_parallel_size, par.pipeline_parallel_size, *local)
    for stage in range(topo.pp):  # every rank creates every group, in the same order
        ranks = list(range(stage * topo.tp, (stage + 1) * topo.tp))
        group = dist.new_group(ranks, timeout=timeout) if topo.tp > 1 else None
        if rank in ranks:
            topo.tp_group = group
    topo.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return topo


def broadcast_setup(obj, topo: Topology):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=topo.cpu_group)
    return box[0]


def _device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device_type)


def build_runner(setup: Setup, topo: Topology) -> ModelRunner:
    """Load this rank's shard, agree on pool sizes with the other ranks, build its runner."""
    torch.set_num_threads(setup.threads)
    device = _device(setup.device_type, topo.local_rank)
    dtype = getattr(torch, setup.dtype) if setup.dtype else None
    topo.moe_parallel = setup.parallel.moe_mode(read_config(setup.model_dir))
    shard = topo.shard
    comm = _tp_comm(setup, topo, device)
    model = load_shard(setup.model_dir, shard, device, dtype, comm)
    cfg = model.config
    layers = shard.layers(cfg.num_hidden_layers)
    kv_heads = model.model.layers[layers[0]].self_attn.num_kv_heads
    p = next(model.parameters())
    kv = setup.kv
    # KV groups: a block's bytes over this rank's full layers and over its sliding ones (none: all full)
    sliding = sum(bool(kv.window) and cfg.is_sliding(i) for i in layers if cfg.is_attention_layer(i))
    full_bytes, window_bytes = (
        kv_block_bytes(model, kv.block_size, p.dtype, kv.kv_cache_dtype, n, kv_heads)
        for n in (len(layers) - sliding, sliding)
    )
    budget = None
    if kv.num_kv_blocks is None:
        budget = kv_budget_bytes(
            device,
            cfg,
            kv_cache_bytes=kv.kv_cache_bytes,
            kv_cache_fraction=kv.kv_cache_fraction,
            gpu_memory_utilization=kv.gpu_memory_utilization,
            max_num_batched_tokens=kv.max_num_batched_tokens,
            max_num_seqs=kv.max_num_seqs,
            elem=p.element_size(),
            tp=topo.tp,
            ranks_on_host=topo.local_world,
        )
    via = "shm" if isinstance(comm, ShmGroup) else "gloo/nccl" if comm is not None else "-"
    mine = (budget, full_bytes, window_bytes, weight_bytes(model), via)
    every: list = [None] * topo.world
    dist.all_gather_object(every, mine, group=topo.cpu_group)
    pools = agree_pools(kv, [e[:3] for e in every])
    topo.stats = {
        "weight_bytes": [e[3] for e in every],
        "kv_block_bytes": [e[1] + e[2] for e in every],  # one block over all of the rank's layers
        # the rank's device KV pools: with KV groups, its sliding layers' are the smaller pool's
        "kv_bytes": [pools.num_blocks * e[1] + pools.num_window_blocks * e[2] for e in every],
        "tp_collectives": [e[4] for e in every],  # per rank: shared memory, the process group, or none (T=1)
    }
    if topo.rank == 0 and kv.window:
        log.info(
            "KV groups on %d ranks: %d blocks for the full layers, %d for the sliding-window layers (window %d); "
            "host swap %d + %d; KV bytes per rank %s",
            topo.world, pools.num_blocks, pools.num_window_blocks, kv.window, pools.num_host_blocks,
            pools.num_window_host_blocks, topo.stats["kv_bytes"],
        )  # fmt: skip
    return ModelRunner(
        model, pools.num_blocks, kv.block_size, pools.num_host_blocks, kv.kv_cache_dtype, layers=layers,
        window_blocks=pools.num_window_blocks, window_host_blocks=pools.num_window_host_blocks,
    )  # fmt: skip


def agree_pools(kv: KVSizing, ranks: list[tuple[int | None, int, int]]) -> Pools:
    """One set of pool sizes for every rank, from each rank's (KV budget, a block's bytes over its
    full layers, over its sliding layers): the block manager's block ids mean the same blocks on
    every rank, so the smallest rank's capacity wins. With KV groups the split is the single
    process's (serve/engine/sizing.py), over every rank at once."""
    swap = kv.swap_space_bytes
    if not kv.window:
        sizes = [full for _, full, _ in ranks]
        num_blocks = kv.num_kv_blocks
        if num_blocks is None:
            num_blocks = min(budget // full for budget, full, _ in ranks)
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block on some rank (per-rank block: {sizes} bytes)")
        return Pools(num_blocks, min(swap // full for full in sizes))
    demand = window_demand(kv.block_size, kv.max_num_seqs, kv.max_num_batched_tokens, kv.window)
    if kv.num_kv_blocks is not None:
        num_blocks, num_window = kv.num_kv_blocks, min(kv.num_kv_blocks, demand)
    else:
        num_blocks, num_window = group_split(ranks, demand)
        if num_window < 1:
            sizes = [(full, window) for _, full, window in ranks]
            raise ValueError(
                f"the KV budget holds no block of the two KV groups on some rank (per-rank: {sizes} bytes)"
            )
    host, host_window = group_split([(swap, full, window) for _, full, window in ranks], demand)
    return Pools(num_blocks, host, None, num_window, host_window)


def _tp_comm(setup: Setup, topo: Topology, device: torch.device):
    """The tensor-parallel group the layers use: shared memory when every rank of it is on this
    host's CPU (serve/parallel/comm.py), else the process group itself."""
    if topo.tp == 1 or not setup.parallel.shared_memory or not shared_memory_usable(device):
        return topo.tp_group
    hosts: list = [None] * topo.world
    dist.all_gather_object(hosts, socket.gethostname(), group=topo.cpu_group)
    stage = topo.shard.pp_rank
    if len({hosts[r] for r in range(stage * topo.tp, (stage + 1) * topo.tp)}) > 1:
        return topo.tp_group
    cfg = read_config(setup.model_dir)
    elem = 4  # fp32 activations at most
    capacity = max(setup.kv.max_num_batched_tokens * cfg.hidden_size, 2**20) * elem
    return ShmGroup(
        topo.tp_group, topo.shard.tp_rank, topo.tp, capacity, stage * topo.tp, setup.parallel.distributed_timeout_s
    )


@torch.inference_mode()
def run_stage(
    runner: ModelRunner, plans: list[StepPlan], topo: Topology, positions_in_cache: bool = False
) -> tuple[list, list]:
    """This rank's layers over every micro-batch, in order: from the embedding (the runner's step
    pass, e.g. LayerSkip's late entry at T x 1) or the previous stage, to the next stage or the head.
    Returns (the driver's (logits, hidden) per micro-batch when it is also the last stage, the sends
    still in flight)."""
    shard, cfg = topo.shard, runner.model.config
    tp, pp_rank = shard.tp_rank, shard.pp_rank
    pending, results = [], []
    for plan in plans:
        if shard.first_stage:
            x = runner.forward_step(plan, positions_in_cache)
        else:  # the last stage's last layer answers the sampled rows alone (model_runner.py)
            x = torch.empty(1, plan.num_tokens, cfg.hidden_size, dtype=runner.dtype, device=runner.device)
            dist.recv(x, src=(pp_rank - 1) * topo.tp + tp)
            x = runner.forward(plan, x, sampled_only=runner.answer_sampled_rows)
        if not shard.last_stage:
            pending.append((dist.isend(x, dst=(pp_rank + 1) * topo.tp + tp), x))
            continue
        logits, hidden = runner.head(plan, x)
        if topo.rank == 0:
            results.append((logits, hidden))
        elif tp == 0 and plan.sample_rows:
            for t in (logits, hidden) if plan.return_hidden else (logits,):
                t = t.contiguous()
                pending.append((dist.isend(t, dst=0), t))
    return results, pending


@torch.inference_mode()
def logits_from_last_stage(runner: ModelRunner, plans: list[StepPlan], topo: Topology) -> list:
    """The driver (stage 0) receives each micro-batch's sampled rows from the last stage."""
    cfg, results = runner.model.config, []
    for plan in plans:
        rows = len(plan.sample_rows)
        logits = torch.empty(rows, cfg.vocab_size, dtype=runner.dtype, device=runner.device)
        hidden = torch.empty(rows, cfg.hidden_size, dtype=runner.dtype, device=runner.device)
        if rows:
            dist.recv(logits, src=topo.last_rank)
            if plan.return_hidden:
                dist.recv(hidden, src=topo.last_rank)
        results.append((logits, hidden if plan.return_hidden else None))
    return results


def run_step(
    runner: ModelRunner, plans: list[StepPlan], topo: Topology, positions_in_cache: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """This rank's part of one step; on the driver, each micro-batch's (logits, hidden) of the
    sampled rows."""
    results, pending = run_stage(runner, plans, topo, positions_in_cache)
    if topo.rank == 0 and not topo.shard.last_stage:
        results = logits_from_last_stage(runner, plans, topo)
    for work, _ in pending:
        work.wait()
    return results


def post_command(cmd: tuple, topo: Topology) -> list:
    """Hand `cmd` to every worker, point to point, without waiting for them to take it: a
    collective (broadcast) would wait for the busiest rank, and a pipelined driver must go on
    feeding stage 0 while the last stage still works. Returns the sends (wait on them later)."""
    data = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
    header = torch.tensor([len(data)], dtype=torch.int64)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return [(dist.isend(t, dst=r, group=topo.cpu_group), t) for r in range(1, topo.world) for t in (header, payload)]


def _receive(topo: Topology) -> tuple:
    header = torch.empty(1, dtype=torch.int64)
    dist.recv(header, src=0, group=topo.cpu_group)
    payload = torch.empty(int(header), dtype=torch.uint8)
    dist.recv(payload, src=0, group=topo.cpu_group)
    return pickle.loads(payload.numpy().tobytes())


def _serve_commands(runner: ModelRunner, topo: Topology) -> None:
    tables = GroupTableReceiver()
    late: LateEntries | None = None  # LayerSkip's late entry, once the driver installs it (T x 1)
    while True:
        cmd = _receive(topo)
        kind = cmd[0]
        if kind == "step":
            plans = [tables.decode(w, runner.block_size) for w in cmd[1]]
            run_step(runner, plans, topo, cmd[1][0].positions_in_cache)
        elif kind == "draft":
            late.draft(tables.decode(cmd[1], runner.block_size).chunks, cmd[2])
        elif kind == "late_entry":
            late = install_late_entry(runner, cmd[1])
        elif kind == "ops":
            runner.apply_block_ops(cmd[1])
        elif kind == "move":
            runner.move_slots(*cmd[1:])
        elif kind == "ping":
            answer_heartbeat(topo)
        elif kind == "stop":
            return


def answer_heartbeat(topo: Topology) -> None:
    """The heartbeat's answer: a barrier, so the driver waits for every rank (a stopped or hung one
    times it out) instead of only handing its ping to the socket."""
    dist.barrier(group=topo.cpu_group)


def worker_main(
    rank: int,
    world: int,
    rendezvous: Rendezvous,
    par: ParallelConfig,
    device_type: str,
    local: tuple[int, int] | None = None,
) -> None:
    """A worker rank: join the group, build the shard the driver describes, run its commands. A
    failure is written to the driver's store (so its error names the cause) and ends the process.
    `local` is (local rank, ranks on this node); spawned workers share the driver's node.

    SIGINT and SIGTERM are ignored: Ctrl-C reaches the whole process group and scancel/torchrun
    signal every task, and a worker that died first would fail the requests the driver is
    draining. The driver's ("stop",) ends it; so does its group breaking (the driver died) or
    going silent for distributed_timeout_s. A launcher's SIGKILL after its grace period still works."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    store = None
    try:
        store = _connect(rendezvous, world, timedelta(seconds=par.distributed_timeout_s))
        if store is not None:
            store.set(f"baton/joined/{rank}", "1")
        topo = init_groups(rank, world, par, device_type, store or rendezvous, local or (rank, world))
        setup = broadcast_setup(None, topo)
        runner = build_runner(setup, topo)
        log.info("rank %d ready (pid %d): %s, layers %s", rank, os.getpid(), topo.shard, list(runner.layer_ids))
        _serve_commands(runner, topo)
        log.info("rank %d stopping", rank)
    except Exception as e:
        log.exception("rank %d failed; exiting (the driver sees its group break)", rank)
        if store is not None:
            try:
                store.set(f"baton/error/{rank}", f"{type(e).__name__}: {e}"[:2000])
            except Exception:
                pass
        os._exit(1)
    dist.destroy_process_group()


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
