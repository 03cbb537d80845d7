"""The driver and its workers: one engine, T x P ranks holding the shards (vLLM's executor).

Rank r is tensor rank r % T of pipeline stage r // T; rank 0 is the driver: it keeps the
scheduler, block manager and sampler (serve/engine.py is unchanged) and is also stage 0's first
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
(env://). Failure: a worker that dies breaks the driver's next collective at once, one that hangs
is cut off by the group timeout; the idle driver pings every heartbeat_s so a dead worker is noticed
without traffic. Either way the runner raises WorkerLost (an EngineFault: the engine is dead, its
requests fail, health turns NOT_SERVING) and every worker is stopped.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from baton.common.config import ModelConfig
from baton.serve.block_manager import BlockOps
from baton.serve.faults import EngineFault
from baton.serve.kv_budget import activation_reserve, kv_budget_bytes
from baton.serve.model_runner import ExecuteResult, ModelRunner, kv_block_bytes
from baton.serve.parallel.config import ParallelConfig
from baton.serve.parallel.loader import load_shard, weight_bytes
from baton.serve.parallel.shard import Shard
from baton.serve.sequence import Sequence
from baton.serve.step_plan import StepPlan, TableReceiver, TableSender, plan_chunks, split_for_pipeline

log = logging.getLogger(__name__)


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
    rank: int, world: int, par: ParallelConfig, device_type: str, rendezvous: Rendezvous | dist.Store
) -> Topology:
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=par.distributed_timeout_s)
    if isinstance(rendezvous, str):
        dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, store=rendezvous, rank=rank, world_size=world, timeout=timeout)
    topo = Topology(rank, world, par.tensor_parallel_size, par.pipeline_parallel_size)
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


def _device(device_type: str) -> torch.device:
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device(device_type)


def _build(setup: Setup, topo: Topology) -> ModelRunner:
    """Load this rank's shard, agree on pool sizes with the other ranks, build its runner."""
    torch.set_num_threads(setup.threads)
    device = _device(setup.device_type)
    dtype = getattr(torch, setup.dtype) if setup.dtype else None
    shard = Shard(topo.shard.tp_rank, topo.tp, topo.shard.pp_rank, topo.pp, setup.parallel.moe_parallel)
    model = load_shard(setup.model_dir, shard, device, dtype, topo.tp_group)
    cfg = model.config
    layers = shard.layers(cfg.num_hidden_layers)
    kv_heads = model.model.layers[layers[0]].self_attn.num_kv_heads
    p = next(model.parameters())
    kv = setup.kv
    block_bytes = kv_block_bytes(model, kv.block_size, p.dtype, kv.kv_cache_dtype, len(layers), kv_heads)
    if kv.num_kv_blocks is not None:
        blocks = kv.num_kv_blocks
    else:
        reserve = activation_reserve(cfg, kv.max_num_batched_tokens, kv.max_num_seqs, p.element_size(), topo.tp)
        budget = kv_budget_bytes(
            device,
            kv_cache_bytes=kv.kv_cache_bytes,
            kv_cache_fraction=kv.kv_cache_fraction,
            gpu_memory_utilization=kv.gpu_memory_utilization,
            reserve=reserve,
            ranks_on_host=int(os.environ.get("LOCAL_WORLD_SIZE", topo.world)),
        )
        blocks = budget // block_bytes
    mine = (blocks, kv.swap_space_bytes // block_bytes, weight_bytes(model), block_bytes)
    every: list = [None] * topo.world
    dist.all_gather_object(every, mine, group=topo.cpu_group)
    num_blocks, num_host = min(e[0] for e in every), min(e[1] for e in every)
    if num_blocks < 1:
        raise ValueError(f"the KV budget holds no block on some rank (per-rank block: {block_bytes} bytes)")
    topo.stats = {"weight_bytes": [e[2] for e in every], "kv_block_bytes": [e[3] for e in every]}
    return ModelRunner(model, num_blocks, kv.block_size, num_host, kv.kv_cache_dtype, layers=layers)


@torch.inference_mode()
def run_step(
    runner: ModelRunner, plans: list[StepPlan], topo: Topology
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """This rank's part of one step, micro-batch after micro-batch; on the driver, each micro-batch's
    (logits, hidden) of the sampled rows."""
    shard, cfg = topo.shard, runner.model.config
    tp, pp_rank = shard.tp_rank, shard.pp_rank
    pending, results = [], []
    for plan in plans:
        x = None
        if not shard.first_stage:
            x = torch.empty(1, plan.num_tokens, cfg.hidden_size, dtype=runner.dtype, device=runner.device)
            dist.recv(x, src=(pp_rank - 1) * topo.tp + tp)
        x = runner.forward(plan, x)
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
    if topo.rank == 0 and not shard.last_stage:
        for plan in plans:
            rows = len(plan.sample_rows)
            logits = torch.empty(rows, cfg.vocab_size, dtype=runner.dtype, device=runner.device)
            hidden = torch.empty(rows, cfg.hidden_size, dtype=runner.dtype, device=runner.device)
            if rows:
                dist.recv(logits, src=topo.last_rank)
                if plan.return_hidden:
                    dist.recv(hidden, src=topo.last_rank)
            results.append((logits, hidden if plan.return_hidden else None))
    for work, _ in pending:
        work.wait()
    return results


def _serve_commands(runner: ModelRunner, topo: Topology) -> None:
    tables = TableReceiver()
    while True:
        cmd = _broadcast(None, topo)
        kind = cmd[0]
        if kind == "step":
            run_step(runner, [tables.decode(w, runner.block_size) for w in cmd[1]], topo)
        elif kind == "ops":
            runner.apply_block_ops(cmd[1])
        elif kind == "move":
            runner.move_slots(cmd[1], cmd[2])
        elif kind == "stop":
            return


def worker_main(rank: int, world: int, rendezvous: Rendezvous, par: ParallelConfig, device_type: str) -> None:
    """A worker rank: join the group, build the shard the driver describes, run its commands. A
    failure is written to the driver's store (so its error names the cause) and ends the process."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    store = None
    try:
        store = _connect(rendezvous, world, timedelta(seconds=par.distributed_timeout_s))
        if store is not None:
            store.set(f"baton/joined/{rank}", "1")
        topo = _init_groups(rank, world, par, device_type, store if store is not None else rendezvous)
        setup = _broadcast(None, topo)
        runner = _build(setup, topo)
        log.info("rank %d ready: %s, layers %s", rank, topo.shard, list(runner.layer_ids))
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


class DistributedRunner:
    """The driver's model runner: ModelRunner's interface, run on every rank."""

    def __init__(self, model_dir: str | Path, setup: Setup, par: ParallelConfig, init_method: str | None = None):
        self.parallel, world = par, par.world_size
        self.procs: list[mp.process.BaseProcess] = []
        self.store: dist.Store | None = None
        timeout = timedelta(seconds=par.distributed_timeout_s)
        if init_method is None:  # local: spawn the workers on this host, rendezvous at our own store
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
        self.failure: str | None = None
        self.control_s, self.steps = 0.0, 0  # the control plane (command broadcasts), measured
        t0 = time.monotonic()
        try:
            if self.store is not None:
                self._wait_for_workers(world, par.distributed_timeout_s)
            self.topo = _init_groups(0, world, par, setup.device_type, self.store or init_method)
            _broadcast(setup, self.topo)
            self.local = _build(setup, self.topo)
        except Exception as e:
            why = self._worker_errors()
            self._kill()
            if why:
                raise RuntimeError(f"distributed start-up failed: {why}") from e
            raise
        log.info(
            "%d ranks ready in %.1f s (tensor %d x pipeline %d); weights per rank %s MiB",
            world,
            time.monotonic() - t0,
            par.tensor_parallel_size,
            par.pipeline_parallel_size,
            [round(b / 2**20, 1) for b in self.topo.stats["weight_bytes"]],
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
                raise RuntimeError(f"the workers did not join within distributed_timeout_s={timeout_s}")
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
    def _command(self, cmd: tuple) -> None:
        if self.failure is not None:
            raise WorkerLost(self.failure)
        t0 = time.perf_counter()
        try:
            _broadcast(cmd, self.topo)
        except Exception as e:
            self._lost(f"a worker rank stopped answering ({e})")
        self.control_s += time.perf_counter() - t0
        self._last = time.monotonic()

    def _lost(self, reason: str):
        if self.failure is None:
            why = self._worker_errors()
            self.failure = f"{reason}; {why}" if why else reason
            log.error("distributed serving is down: %s", reason)
        self._kill()
        raise WorkerLost(self.failure)

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

    def execute(
        self,
        scheduled: list[tuple[Sequence, int]],
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
    ) -> ExecuteResult:
        plans, wires, groups = [], [], []
        for part in split_for_pipeline(scheduled, self.parallel.pipeline_parallel_size):
            chunks, part_groups = plan_chunks(part)
            flags = (positions_in_cache, window_in_cache, return_hidden)
            plans.append(StepPlan.from_chunks(chunks, self.block_size, *flags))
            wires.append(self.tables.encode(chunks, *flags))
            groups += part_groups
        with self._lock:
            self._command(("step", wires))
            try:
                results = run_step(self.local, plans, self.topo)
            except Exception as e:
                self._lost(f"the sharded forward failed ({e!r})")
            self.steps += 1
        logits = torch.cat([lg for lg, _ in results])
        hidden = torch.cat([h for _, h in results]) if return_hidden else None
        return ExecuteResult(logits, groups, hidden)

    # ------------------------------------------------------------------------------ health
    def check_health(self) -> None:
        if self.failure is not None:
            raise WorkerLost(self.failure)
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            self._lost(f"worker process {', '.join(dead)} exited")

    def _beat(self) -> None:
        while self.failure is None and not getattr(self, "_stopped", False):
            time.sleep(self.parallel.heartbeat_s)
            if time.monotonic() - self._last < self.parallel.heartbeat_s:
                continue
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self.failure is None and not getattr(self, "_stopped", False):
                    self.check_health()
                    self._command(("ping",))
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
                    _broadcast(("stop",), self.topo)
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
