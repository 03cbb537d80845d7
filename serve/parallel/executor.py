"""The driver and its workers: one engine, T x P ranks holding the shards (vLLM's executor).

Rank r is tensor rank r % T of pipeline stage r // T; rank 0 is the driver: it keeps the
scheduler, block manager and sampler (serve/engine/engine.py is unchanged) and is also stage 0's first
tensor rank. Every step it broadcasts one small command over a CPU (gloo) group - the StepPlan's
token ids, positions, slot mapping and block tables, or the step's block copies - and every rank
turns it into tensors on its own device. Activations travel on the device group (gloo on CPU,
NCCL on CUDA): the tensor-parallel all-reduces inside the layers, the hidden states between
pipeline stages, and the sampled rows' logits from the last stage back to the driver.

Pipeline parallelism splits each step's sequences into P micro-batches that follow each other
through the stages (stage s works on micro-batch m while stage s+1 works on m-1), so the stages
overlap within a step.

Locally the workers are spawned here (multiprocessing, spawn); across nodes they are started by
torchrun or srun running `baton serve` with the same arguments, and join the driver's rendezvous
(env://, from baton.common.launch). Failure: a worker that dies breaks the driver's next
collective at once (a socket resets; in a shared-memory group the waiter sees its pid gone), one
that hangs is cut off after distributed_timeout_s; while idle, the engine watches the spawned
processes and the driver sends a heartbeat every heartbeat_s that every rank answers (a barrier),
so a dead or stopped remote worker is noticed without traffic too. Either way the runner raises
WorkerLost (an EngineFault: the engine is dead, its requests fail, health turns NOT_SERVING with
the reason) and every spawned worker is killed; launched ones exit when the driver does, or after
distributed_timeout_s without a command.
Workers ignore SIGTERM/SIGINT: the driver drains first, then stops them.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from baton.common.checkpoint import read_config
from baton.common.config import ModelConfig
from baton.serve.core.faults import EngineFault
from baton.serve.core.sequence import Sequence
from baton.serve.parallel.comm import ShmGroup, pid_running, shared_memory_usable
from baton.serve.parallel.config import ParallelConfig
from baton.serve.parallel.draft import draft_pass
from baton.serve.parallel.loader import load_shard, weight_bytes
from baton.serve.parallel.shard import Shard
from baton.serve.runner.kv_budget import kv_budget_bytes
from baton.serve.runner.model_runner import ExecuteResult, ModelRunner, kv_block_bytes
from baton.serve.runner.step_plan import (
    Chunk,
    StepPlan,
    TableReceiver,
    TableSender,
    WireStep,
    plan_chunks,
    split_for_pipeline,
)
from baton.serve.scheduling.block_manager import BlockOps

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

    @property
    def shard(self) -> Shard:
        return Shard(self.rank % self.tp, self.tp, self.rank // self.tp, self.pp)

    @property
    def last_rank(self) -> int:  # the last stage's first tensor rank: it sends logits to the driver
        return (self.pp - 1) * self.tp


Rendezvous = str | tuple[str, int]  # "env://" (torchrun/srun), or the driver's TCPStore (host, port)


def _connect(rendezvous: Rendezvous, world: int, timeout: timedelta) -> dist.Store | None:
    if isinstance(rendezvous, str):
        return None
    host, port = rendezvous
    return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)


def _init_groups(
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


def _broadcast(obj, topo: Topology):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=topo.cpu_group)
    return box[0]


def _device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device_type)


def _build(setup: Setup, topo: Topology) -> ModelRunner:
    """Load this rank's shard, agree on pool sizes with the other ranks, build its runner."""
    torch.set_num_threads(setup.threads)
    device = _device(setup.device_type, topo.local_rank)
    dtype = getattr(torch, setup.dtype) if setup.dtype else None
    moe = setup.parallel.moe_mode(read_config(setup.model_dir))
    shard = Shard(topo.shard.tp_rank, topo.tp, topo.shard.pp_rank, topo.pp, moe)
    comm = _tp_comm(setup, topo, device)
    model = load_shard(setup.model_dir, shard, device, dtype, comm)
    cfg = model.config
    layers = shard.layers(cfg.num_hidden_layers)
    kv_heads = model.model.layers[layers[0]].self_attn.num_kv_heads
    p = next(model.parameters())
    kv = setup.kv
    block_bytes = kv_block_bytes(model, kv.block_size, p.dtype, kv.kv_cache_dtype, len(layers), kv_heads)
    if kv.num_kv_blocks is not None:
        blocks = kv.num_kv_blocks
    else:
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
        blocks = budget // block_bytes
    via = "shm" if isinstance(comm, ShmGroup) else "gloo/nccl" if comm is not None else "-"
    mine = (blocks, kv.swap_space_bytes // block_bytes, weight_bytes(model), block_bytes, via)
    every: list = [None] * topo.world
    dist.all_gather_object(every, mine, group=topo.cpu_group)
    num_blocks, num_host = min(e[0] for e in every), min(e[1] for e in every)
    if num_blocks < 1:
        raise ValueError(f"the KV budget holds no block on some rank (per-rank block: {block_bytes} bytes)")
    topo.stats = {
        "weight_bytes": [e[2] for e in every],
        "kv_block_bytes": [e[3] for e in every],
        "tp_collectives": [e[4] for e in every],  # per rank: shared memory, the process group, or none (T=1)
    }
    return ModelRunner(model, num_blocks, kv.block_size, num_host, kv.kv_cache_dtype, layers=layers)


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
def _stage(
    runner: ModelRunner, plans: list[StepPlan], topo: Topology, late: tuple[list[list[Chunk]], bool] | None = None
) -> tuple[list, list]:
    """This rank's layers over every micro-batch, in order: from the embedding or the previous
    stage, to the next stage or the head. Returns (the driver's (logits, hidden) per micro-batch
    when it is also the last stage, the sends still in flight). With LayerSkip's entries kept
    (draft.py; T x 1 only), `late` is (each plan's chunks, positions_in_cache): rows enter at E."""
    shard, cfg = topo.shard, runner.model.config
    tp, pp_rank = shard.tp_rank, shard.pp_rank
    pending, results = [], []
    entries, runner.late_entries = runner.late_entries, {}
    for i, plan in enumerate(plans):
        x = None
        if not shard.first_stage:
            x = torch.empty(1, plan.num_tokens, cfg.hidden_size, dtype=runner.dtype, device=runner.device)
            dist.recv(x, src=(pp_rank - 1) * topo.tp + tp)
        if entries and late is not None:
            x = runner.forward_late(plan, late[0][i], entries, late[1])
        else:  # the last stage's last layer answers the sampled rows alone (model_runner.py)
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
    runner.num_executes += 1  # an entry is for the step right after its draft only
    return results, pending


@torch.inference_mode()
def _from_last_stage(runner: ModelRunner, plans: list[StepPlan], topo: Topology) -> list:
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
    runner: ModelRunner, plans: list[StepPlan], topo: Topology, late: tuple[list[list[Chunk]], bool] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """This rank's part of one step; on the driver, each micro-batch's (logits, hidden) of the
    sampled rows."""
    results, pending = _stage(runner, plans, topo, late)
    if topo.rank == 0 and not topo.shard.last_stage:
        results = _from_last_stage(runner, plans, topo)
    for work, _ in pending:
        work.wait()
    return results


def _post(cmd: tuple, topo: Topology) -> list:
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


def _chunks(wire: WireStep, tables: TableReceiver) -> list[Chunk]:
    """A decoded step's chunks with their whole block tables, as the driver planned them."""
    return [dataclasses.replace(c, block_table=tables.tables[c.seq_id]) for c in wire.chunks]


def _serve_commands(runner: ModelRunner, topo: Topology) -> None:
    tables = TableReceiver()
    while True:
        cmd = _receive(topo)
        kind = cmd[0]
        if kind == "step":
            plans = [tables.decode(w, runner.block_size) for w in cmd[1]]
            late = None
            if runner.late_entries:
                late = ([_chunks(w, tables) for w in cmd[1]], cmd[1][0].positions_in_cache)
            run_step(runner, plans, topo, late)
        elif kind == "draft":
            draft_pass(runner, tables.decode(cmd[1], runner.block_size), _chunks(cmd[1], tables), cmd[2], cmd[3])
        elif kind == "ops":
            runner.apply_block_ops(cmd[1])
        elif kind == "move":
            runner.move_slots(cmd[1], cmd[2])
        elif kind == "ping":
            _pong(topo)
        elif kind == "stop":
            return


def _pong(topo: Topology) -> None:
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
        topo = _init_groups(rank, world, par, device_type, store or rendezvous, local or (rank, world))
        setup = _broadcast(None, topo)
        runner = _build(setup, topo)
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


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


@dataclass
class InFlight:
    """A submitted step: what collect() needs to finish it."""

    command: int
    plans: list[StepPlan]
    groups: list[tuple[Sequence, int]]
    results: list  # the driver's own results (when it is also the last stage)
    pending: list  # its sends still in flight
    return_hidden: bool


class DistributedRunner:
    """The driver's model runner: ModelRunner's interface, run on every rank.

    Without `init_method` the workers are spawned here, on this node; with one (a launched job,
    serve/parallel/__init__.py) they are the launcher's other ranks, `local_world` of them on this node."""

    def __init__(self, setup: Setup, par: ParallelConfig, init_method: str | None = None, local_world: int = 0):
        self.parallel, world = par, par.world_size
        self.procs: list[mp.process.BaseProcess] = []
        self.store: dist.Store | None = None
        timeout = timedelta(seconds=par.distributed_timeout_s)
        if init_method is None:  # local: spawn the workers on this host, rendezvous at our own store
            local_world = world
            # port 0: the OS picks a free port as the store binds it (no race with other jobs)
            self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
            ctx = mp.get_context("spawn")
            for rank in range(1, world):
                proc = ctx.Process(
                    target=worker_main,
                    args=(rank, world, ("127.0.0.1", self.store.port), par, setup.device_type),
                    name=f"baton-worker-{rank}",
                    daemon=True,
                )
                proc.start()
                self.procs.append(proc)
        self._lock = threading.Lock()
        self.tables = TableSender()  # the block tables the workers hold, sent as deltas
        self._posted: deque[tuple[int, list]] = deque()  # commands posted, not yet known taken
        self._posted_n = 0
        self.in_flight = 0  # steps submitted, not collected
        self.max_in_flight = par.pipeline_parallel_size  # the engine pipelines steps when > 1
        self.failure: str | None = None
        self.control_s, self.steps = 0.0, 0  # the control plane (command broadcasts), measured
        t0 = time.monotonic()
        try:
            if self.store is not None:
                self._wait_for_workers(world, max(par.distributed_timeout_s, SPAWN_S))
            self.topo = _init_groups(0, world, par, setup.device_type, self.store or init_method, (0, local_world))
            _broadcast(setup, self.topo)
            self.local = _build(setup, self.topo)
        except Exception as e:
            why = self._worker_errors()
            self._kill()
            if why:
                raise RuntimeError(f"distributed start-up failed: {why}") from e
            raise
        log.info(
            "%d ranks ready in %.1f s (tensor %d x pipeline %d); weights per rank %s MiB; TP collectives %s; %s",
            world,
            time.monotonic() - t0,
            par.tensor_parallel_size,
            par.pipeline_parallel_size,
            [round(b / 2**20, 1) for b in self.topo.stats["weight_bytes"]],
            self.topo.stats["tp_collectives"],
            f"spawned worker pids {[p.pid for p in self.procs]}" if self.procs else "workers started by the launcher",
        )
        self.model_config: ModelConfig = self.local.model.config
        self.device, self.dtype, self.block_size = self.local.device, self.local.dtype, self.local.block_size
        self.num_blocks, self.num_host_blocks = self.local.num_blocks, self.local.num_host_blocks
        self._last = time.monotonic()
        self._heartbeat = threading.Thread(target=self._beat, name="baton-heartbeat", daemon=True)
        self._heartbeat.start()

    def _wait_for_workers(self, world: int, timeout_s: float) -> None:
        """Every spawned worker has reached our store - or one died, or the time is up: say which."""
        keys = [f"baton/joined/{r}" for r in range(1, world)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            dead = [p for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(
                    f"worker {dead[0].name} exited (code {dead[0].exitcode}) before joining: "
                    + (self._worker_errors() or "see its log above")
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the spawned workers did not join within {timeout_s:.0f} s")
            time.sleep(0.05)

    def _worker_errors(self) -> str:
        """What failed workers wrote to the store before exiting."""
        if self.store is None:
            return ""
        found = []
        for r in range(1, self.parallel.world_size):
            key = f"baton/error/{r}"
            try:
                if self.store.check([key]):
                    found.append(f"rank {r}: {self.store.get(key).decode()}")
            except Exception:
                break
        return "; ".join(found)

    # ------------------------------------------------------------------------------ commands
    def _command(self, cmd: tuple) -> int:
        """Post `cmd` to every worker; returns its number (settle(n) waits until they took it)."""
        if self.failure is not None:
            raise WorkerLost(self.failure)
        t0 = time.perf_counter()
        try:
            works = _post(cmd, self.topo)
        except Exception as e:
            self._lost(f"a worker rank stopped answering ({e})")
        self._posted_n += 1
        self._posted.append((self._posted_n, works))
        self.control_s += time.perf_counter() - t0
        self._last = time.monotonic()
        return self._posted_n

    def _settle(self, upto: int | None = None) -> None:
        """Wait for the posted commands up to number `upto` (all by default) to be taken."""
        try:
            while self._posted and (upto is None or self._posted[0][0] <= upto):
                for work, _ in self._posted.popleft()[1]:
                    work.wait()
        except Exception as e:
            self._lost(f"a worker rank stopped answering ({e})")

    def _lost(self, reason: str):
        if self.failure is None:
            self._await_a_death()
            self.failure = "; ".join(filter(None, (self._dead_workers(), reason, self._worker_errors())))
            log.error("distributed serving is down: %s", self.failure)
        self._kill()
        raise WorkerLost(self.failure)

    def _await_a_death(self) -> None:
        """One worker may be dying still: wait until it can be reaped, so the failure says which.
        A SIGKILLed worker's leader thread is a zombie (what the shared-memory waiter sees) long
        before waitpid can reap it: its other threads tear down first, which took over 5 s on a
        loaded CI machine, and the failure then named only the symptom, not the dead worker.
        So 15 s when one is visibly dying, else 5 s for one that may be about to."""
        dying = any(not pid_running(p.pid) for p in self.procs if p.pid is not None)
        deadline = time.monotonic() + (15.0 if dying else 5.0)
        while self.procs and all(p.is_alive() for p in self.procs):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            # returns once one's threads are all gone; reaping may trail that by a moment
            if not mp.connection.wait([p.sentinel for p in self.procs], timeout=left):
                return
            time.sleep(0.01)

    def apply_block_ops(self, ops: BlockOps) -> None:
        if not (ops.swap_out or ops.swap_in or ops.copies or ops.rerotations):
            return
        with self._lock:
            self._command(("ops", ops))
            self.local.apply_block_ops(ops)

    def release(self, seq_id: int) -> None:
        self.tables.release(seq_id)  # the workers forget it with the next step

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        with self._lock:
            self._command(("move", src, dst))
            self.local.move_slots(src, dst)

    def submit(
        self,
        scheduled: list[tuple[Sequence, int]],
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
        micro_batches: int = 1,
    ) -> InFlight:
        """Start a step: post it to the workers and run the driver's own stage; collect() finishes
        it. With P stages the engine keeps up to P steps submitted (max_in_flight), so the stages
        overlap across steps; a step run alone (execute) is cut into P micro-batches instead,
        which overlap within it."""
        plans, wires, groups, chunked = [], [], [], []
        flags = (positions_in_cache, window_in_cache, return_hidden)
        for part in split_for_pipeline(scheduled, micro_batches):
            chunks, part_groups = plan_chunks(part)
            plans.append(StepPlan.from_chunks(chunks, self.block_size, *flags))
            wires.append(self.tables.encode(chunks, *flags))
            groups += part_groups
            chunked.append(chunks)
        with self._lock:
            number = self._command(("step", wires))
            try:
                results, pending = _stage(self.local, plans, self.topo, (chunked, positions_in_cache))
            except Exception as e:
                self._lost(f"the sharded forward failed ({e!r})")
            self.in_flight += 1
        return InFlight(number, plans, groups, results, pending, return_hidden)

    def collect(self, step: InFlight) -> ExecuteResult:
        """The sampled rows' logits (and hidden states) of a submitted step, oldest first."""
        with self._lock:
            try:
                results = step.results
                if not self.topo.shard.last_stage:
                    results = _from_last_stage(self.local, step.plans, self.topo)
                for work, _ in step.pending:
                    work.wait()
            except Exception as e:
                self._lost(f"the sharded forward failed ({e!r})")
            self._settle(step.command)  # every rank has taken it: they all took part in the step
            self.in_flight -= 1
            self.steps += 1
        logits = torch.cat([lg for lg, _ in results])
        hidden = torch.cat([h for _, h in results]) if step.return_hidden else None
        return ExecuteResult(logits, step.groups, hidden)

    # ------------------------------------------------------------------------------ LayerSkip
    @property
    def can_enter_late(self) -> bool:
        """LayerSkip's KV reuse (draft.py) needs layers < E and the LM head on every rank: T x 1."""
        return self.topo.pp == 1

    @property
    def num_late_rows(self) -> int:
        """Rows that entered at LayerSkip's exit layer so far (every rank counts the same)."""
        return self.local.num_late_rows

    def draft(self, chunks: list[Chunk], exit_layer: int, fresh: bool) -> torch.Tensor:
        """One LayerSkip draft depth on every rank (one-token chunks, draft.py): the rows' logits
        [rows, vocab]; each rank keeps the rows' layer-E inputs for the next step."""
        if not self.can_enter_late:
            raise ValueError("a LayerSkip draft on the ranks needs one pipeline stage")
        plan = StepPlan.from_chunks(chunks, self.block_size)
        with self._lock:
            number = self._command(("draft", self.tables.encode(chunks, False, True, False), exit_layer, fresh))
            try:
                logits = draft_pass(self.local, plan, chunks, exit_layer, fresh)
            except Exception as e:
                self._lost(f"the sharded draft failed ({e!r})")
            self._settle(number)
        return logits

    def execute(
        self,
        scheduled: list[tuple[Sequence, int]],
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
    ) -> ExecuteResult:
        p = self.parallel.pipeline_parallel_size
        return self.collect(self.submit(scheduled, positions_in_cache, window_in_cache, return_hidden, p))

    # ------------------------------------------------------------------------------ health
    def check_health(self) -> None:
        if self.failure is not None:
            raise WorkerLost(self.failure)
        if any(not p.is_alive() for p in self.procs):
            self._lost("")

    def _dead_workers(self) -> str:
        """Which spawned workers have exited, and how (a signal's name, or the exit code)."""
        dead = []
        for p in self.procs:
            if not p.is_alive():
                code = p.exitcode or 0
                how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"
                dead.append(f"worker {p.name} (pid {p.pid}) exited ({how})")
        return ", ".join(dead)

    def _beat(self) -> None:
        # An idle worker waits for its next command at most distributed_timeout_s, then gives up:
        # the heartbeat must come well before that, whatever heartbeat_s says.
        period = min(self.parallel.heartbeat_s, self.parallel.distributed_timeout_s / 4)
        while self.failure is None and not getattr(self, "_stopped", False):
            time.sleep(period)
            if time.monotonic() - self._last < period:
                continue
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self.failure is None and not getattr(self, "_stopped", False) and not self.in_flight:
                    self.check_health()
                    self._command(("ping",))
                    try:
                        _pong(self.topo)
                        self._settle()
                    except WorkerLost:
                        raise
                    except Exception as e:
                        self._lost(
                            f"a worker rank did not answer the heartbeat within {self.parallel.distributed_timeout_s} s ({e})"
                        )
            except WorkerLost:
                pass
            finally:
                self._lock.release()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every worker: politely if the group still works, else by signal."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        with self._lock:
            if self.failure is None:
                try:
                    for work, _ in _post(("stop",), self.topo):
                        work.wait()
                except Exception:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
