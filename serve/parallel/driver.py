"""The driver of a sharded model: a Runner (serve/runner/interface.py) whose every step runs on
all T x P ranks (vLLM's executor); the worker side is serve/parallel/worker.py.

The driver spawns the local workers (or joins the launcher's), builds its own shard, and then per
step broadcasts one command and collects the last stage's logits; with P pipeline stages it keeps
up to P steps submitted (max_in_flight), so the stages overlap across steps too.

Failure: a worker that dies breaks the driver's next collective at once (a socket resets; in a
shared-memory group the waiter sees its pid gone), one that hangs is cut off after
distributed_timeout_s; while idle, the engine watches the spawned processes and the driver sends a
heartbeat every heartbeat_s that every rank answers (a barrier), so a dead or stopped remote worker
is noticed without traffic too. Either way the runner raises WorkerLost (an EngineFault: the
engine is dead, its requests fail, health turns NOT_SERVING with the reason) and every spawned
worker is killed.
"""

from __future__ import annotations

import ast
import logging
import multiprocessing as mp
import multiprocessing.connection
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from baton.common.config import ModelConfig
from baton.common.errors import UserError
from baton.serve.core.sequence import Sequence
from baton.serve.parallel.comm import pid_running
from baton.serve.parallel.config import ParallelConfig
from baton.serve.parallel.tables import GroupTableSender
from baton.serve.parallel.worker import (
    SPAWN_S,
    Setup,
    WorkerLost,
    answer_heartbeat,
    broadcast_setup,
    build_runner,
    init_groups,
    logits_from_last_stage,
    post_command,
    run_stage,
    signal_name,
    worker_main,
)
from baton.serve.runner.late_entry import LateEntries, install_late_entry
from baton.serve.runner.model_runner import ExecuteResult
from baton.serve.runner.step_plan import Chunk, StepPlan, plan_chunks, split_for_pipeline
from baton.serve.scheduling.block_manager import BlockOps

log = logging.getLogger(__name__)


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.unparse(test.left), ast.unparse(test.comparators[0])}
    return sides in ({"__name__", "'__main__'"}, {"__name__", '"__main__"'})


def check_main_guard() -> None:
    """Spawned workers import the main script again (as __mp_main__, as multiprocessing's spawn
    does): a script that starts the engine at its top level, with no `if __name__ == "__main__":`,
    would start it again in every worker, which fails there with Python's bootstrapping message and
    here as a worker that exited before joining. Say what to do instead, before anything starts."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not path.endswith(".py"):  # interactive, -c, a console script: nothing is re-run
        return
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return
    if not any(isinstance(node, ast.If) and _is_main_test(node.test) for node in tree.body):
        raise UserError(
            f'{path} starts tensor/pipeline-parallel serving but has no `if __name__ == "__main__":` guard: '
            "the workers are spawned processes that import the script again, so put the code that creates "
            "the LLM (or engine) under that guard"
        )


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
            check_main_guard()
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
        self.tables = GroupTableSender()  # the block tables the workers hold (both KV groups'), sent as deltas
        self._posted: deque[tuple[int, list]] = deque()  # commands posted, not yet known taken
        self._posted_n = 0
        self.in_flight = 0  # steps submitted, not collected
        self.max_in_flight = par.pipeline_parallel_size  # the engine pipelines steps when > 1
        self.failure: str | None = None
        self.late: LateEntries | None = None  # LayerSkip's late entry on this rank, once installed (T x 1)
        self.control_s, self.steps = 0.0, 0  # the control plane (command broadcasts), measured
        t0 = time.monotonic()
        try:
            if self.store is not None:
                self._wait_for_workers(world, max(par.distributed_timeout_s, SPAWN_S))
            self.topo = init_groups(0, world, par, setup.device_type, self.store or init_method, (0, local_world))
            broadcast_setup(setup, self.topo)
            self.local = build_runner(setup, self.topo)
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
        # KV groups: the sliding-window layers' pools, the same size on every rank (0: one group)
        self.num_window_blocks = self.local.num_window_blocks
        self.num_window_host_blocks = self.local.num_window_host_blocks
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
            works = post_command(cmd, self.topo)
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
        w = ops.window  # KV groups: the sliding-window layers' swaps and copies
        if not (ops.swap_out or ops.swap_in or ops.copies or ops.rerotations) and not (
            w is not None and (w.swap_out or w.swap_in or w.copies)
        ):
            return
        with self._lock:
            self._command(("ops", ops))
            self.local.apply_block_ops(ops)

    def release(self, seq_id: int) -> None:
        self.tables.release(seq_id)  # the workers forget it with the next step

    def keep_state(self, seq_id: int, num_accepted: int) -> None:
        """Sharded models keep no recurrent state: hybrids are served on one process (serve/engine/rules.py)."""

    def move_slots(
        self, src: list[int], dst: list[int], window_src: list[int] | None = None, window_dst: list[int] | None = None
    ) -> None:
        if not src and not window_src:
            return
        with self._lock:
            self._command(("move", src, dst, window_src, window_dst))
            self.local.move_slots(src, dst, window_src, window_dst)

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
        plans, wires, groups = [], [], []
        flags = (positions_in_cache, window_in_cache, return_hidden)
        for part in split_for_pipeline(scheduled, micro_batches):
            chunks, part_groups = plan_chunks(part)
            plans.append(StepPlan.from_chunks(chunks, self.block_size, *flags))
            wires.append(self.tables.encode(chunks, *flags))
            groups += part_groups
        with self._lock:
            number = self._command(("step", wires))
            try:
                results, pending = run_stage(self.local, plans, self.topo, positions_in_cache)
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
                    results = logits_from_last_stage(self.local, step.plans, self.topo)
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
    def install_late_entry(self, exit_layer: int) -> DistributedRunner | None:
        """LayerSkip's late entry (serve/runner/late_entry.py) on every rank's runner; this runner
        is then its proposer's Drafter (draft, num_late_rows). None with pipeline stages: layers < E
        and the LM head are on different stages (the proposer keeps its mirror draft)."""
        if self.topo.pp > 1:
            return None
        with self._lock:
            self._command(("late_entry", exit_layer))
            self.late = install_late_entry(self.local, exit_layer)
        return self

    @property
    def num_late_rows(self) -> int:
        """Rows that entered at LayerSkip's exit layer so far (every rank counts the same)."""
        return 0 if self.late is None else self.late.num_late_rows

    def draft(self, chunks: list[Chunk], fresh: bool) -> torch.Tensor:
        """One LayerSkip draft depth on every rank (one-token chunks): the rows' logits [rows,
        vocab]; each rank keeps the rows' layer-E inputs for the next step in its own LateEntries."""
        if self.late is None:
            raise ValueError("a LayerSkip draft on the ranks needs late entry installed (install_late_entry)")
        with self._lock:
            number = self._command(("draft", self.tables.encode(chunks, False, True, False), fresh))
            try:
                logits = self.late.draft(chunks, fresh)
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
                how = f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"
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
                        answer_heartbeat(self.topo)
                        self._settle()
                    except WorkerLost:
                        raise
                    except Exception as e:
                        limit = self.parallel.distributed_timeout_s
                        self._lost(f"a worker rank did not answer the heartbeat within {limit} s ({e})")
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
                    for work, _ in post_command(("stop",), self.topo):
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
