"""A sharded `baton serve` whose workers fail, for real: a SIGKILLed worker ends the in-flight stream
with an error (not a hang) within seconds, health turns NOT_SERVING naming the dead worker, new
calls get UNAVAILABLE and every other worker is stopped; a worker that hangs (SIGSTOP) is cut off
after --distributed-timeout-s; the server still exits 0 on SIGTERM. A layout the model cannot be
split into is refused (exit 2, one line) before any process or port is opened."""

from __future__ import annotations

import multiprocessing.context
import os
import re
import signal
import threading
import time

import grpc
import psutil
import pytest
import torch
import torch.distributed

from baton.common.cli import main
from baton.serve.client import BatonClient
from baton.serve.parallel.comm import shared_memory_usable

from ..server_fixtures import ServerProcess, offline

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox"
MAX_TOKENS = 200  # far more than are read before the failure: the stream is mid-flight
HANG_TIMEOUT_S = 4.0


def workers(server: ServerProcess) -> list[psutil.Process]:
    """The spawned worker ranks, from the driver's log; each must be the server's own child."""
    pids = [int(p) for p in re.search(r"spawned worker pids \[([\d, ]+)\]", server.log())[1].split(",")]
    procs = [psutil.Process(pid) for pid in pids]
    assert all(p.ppid() == server.proc.pid for p in procs), [p.ppid() for p in procs]
    return procs


def alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Stream:
    """One long greedy stream on a thread: the token ids it got, how it ended, when."""

    def __init__(self, target: str):
        self.ids: list[int] = []
        self.error: grpc.RpcError | None = None
        self.ended: float | None = None
        self.client = BatonClient(target, timeout=120)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for msg in self.client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True):
                self.ids += msg.completions[0].token_ids
        except grpc.RpcError as e:
            self.error = e
        self.ended = time.monotonic()

    def wait_for_tokens(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ids) < n:
            assert self.ended is None and time.monotonic() < deadline, (self.ids, self.error)
            time.sleep(0.005)


@pytest.fixture(scope="module")
def reference(llama_dir):
    return offline(llama_dir, [PROMPT], MAX_TOKENS, ignore_eos=True)[0][0]


def check_failed(server: ServerProcess, stream: Stream, procs: list[psutil.Process], t0: float, bound: float, why: str):
    """The stream ended with an error within `bound` s of t0, health says why, no worker is left."""
    stream.thread.join(bound + 5)
    assert stream.ended is not None, "the stream hangs after the worker failed"
    took = stream.ended - t0
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.INTERNAL, stream.error
    assert took < bound, f"the stream took {took:.1f} s to fail"
    c = stream.client
    assert c.health() == "NOT_SERVING"
    reason = c.server_info().failure_reason
    assert re.search(why, reason), reason
    with pytest.raises(grpc.RpcError) as refused:
        c.complete(PROMPT, max_tokens=2)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and re.search(why, refused.value.details())
    deadline = time.monotonic() + 10
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in procs), [p.pid for p in procs if alive(p)]
    t1 = time.monotonic()
    assert server.terminate(timeout=30) == 0, server.log()[-3000:]
    return took, time.monotonic() - t1


def test_a_killed_worker_fails_the_stream_and_health_and_stops_the_others(llama_dir, tmp_path, reference):
    server = ServerProcess(
        tmp_path, "--model", str(llama_dir), "-tp", "2", "-pp", "2", "--num-kv-blocks", "64", "--block-size", "8"
    )
    procs = workers(server)
    assert len(procs) == 3
    if shared_memory_usable(torch.device("cpu")):  # the driver and rank 1 meet in /dev/shm
        assert "TP collectives ['shm', 'shm', 'shm', 'shm']" in server.log(), server.log()
    stream = Stream(server.target)
    stream.wait_for_tokens(10)
    # Rank 1: the driver's tensor-parallel peer; they meet in shared memory, where no socket breaks
    # when it dies (the waiter watches its pid), and ranks 2 and 3 must be stopped by the driver.
    victim = procs[0]
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    took, exit_s = check_failed(server, stream, procs, t0, 30, rf"worker baton-worker-1 \(pid {victim.pid}\).*SIGKILL")
    assert stream.ids == reference[: len(stream.ids)]  # what it streamed before the failure was right
    print(f"SIGKILLed worker: the stream failed {took * 1e3:.0f} ms later; server exited {exit_s:.1f} s after SIGTERM")


def test_a_hung_worker_is_cut_off_by_the_distributed_timeout(llama_dir, tmp_path, reference):
    server = ServerProcess(
        tmp_path,
        *("--model", str(llama_dir), "-tp", "2", "--num-kv-blocks", "64", "--block-size", "8"),
        *("--distributed-timeout-s", str(HANG_TIMEOUT_S), "--heartbeat-s", "30"),
    )
    procs = workers(server)
    # Idle for longer than the timeout: the heartbeat (sooner than the timeout, whatever
    # --heartbeat-s says) keeps the waiting worker from giving up on the driver.
    time.sleep(HANG_TIMEOUT_S + 1.5)
    with BatonClient(server.target, timeout=30) as c:
        assert c.health() == "SERVING", c.server_info().failure_reason
        assert list(c.complete(PROMPT, max_tokens=8, temperature=0).completions[0].token_ids) == reference[:8]
    stream = Stream(server.target)
    stream.wait_for_tokens(10)
    t0 = time.monotonic()
    procs[0].send_signal(signal.SIGSTOP)  # alive, sockets open, silent: only the timeout can tell
    try:
        took, _ = check_failed(server, stream, procs, t0, HANG_TIMEOUT_S + 10, r"[Tt]imed? ?out|did not reach")
    finally:
        if alive(procs[0]):
            procs[0].kill()
    assert took > HANG_TIMEOUT_S * 0.9, f"failed after {took:.1f} s: not by the timeout"
    assert stream.ids == reference[: len(stream.ids)]
    print(f"SIGSTOPped worker: the stream failed {took:.1f} s later (distributed_timeout_s={HANG_TIMEOUT_S})")


@pytest.mark.parametrize(
    "args, message",
    [
        (["-tp", "3"], "tensor_parallel_size 3 does not divide the model's 4 attention heads"),
        (["-pp", "5"], "pipeline_parallel_size 5 is more than the model's 2 layers"),
        (["-tp", "0"], "tensor_parallel_size must be >= 1, got 0"),
    ],
)
def test_a_bad_layout_is_refused_before_any_process_starts(llama_dir, capsys, monkeypatch, args, message):
    def tripwire(*a, **k):
        pytest.fail("a process, a process group or the server was started")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", tripwire)
    monkeypatch.setattr(torch.distributed, "init_process_group", tripwire)
    monkeypatch.setattr("baton.serve.server.run", tripwire)
    assert main(["serve", "--model", str(llama_dir), "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert err == f"baton serve: error: {message}\n", err


@pytest.mark.parametrize(
    "env, message",
    [
        (  # torchrun started 3 ranks for a 2-rank layout
            {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"},
            "the launcher started 3 processes (launcher) but tensor x pipeline parallel is 2 x 1 = 2",
        ),
        (  # srun -n 4 for a 2-rank layout: SLURM's variables make a 4-rank job
            {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}
            | {"SLURM_JOB_ID": "7", "SLURM_NODELIST": "127.0.0.1"},
            "the launcher started 4 processes (slurm) but tensor x pipeline parallel is 2 x 1 = 2",
        ),
        (  # `baton serve` in a 2-task batch script without srun: one of 2 tasks only under srun
            {"SLURM_NTASKS": "2", "SLURM_PROCID": "0"},
            "SLURM_NTASKS=2 but this process is not an srun task (no SLURM_STEP_ID): start the 2 ranks with "
            "`srun baton serve ...` or a launcher (launchers/serve.sbatch)",
        ),
    ],
)
def test_a_launch_that_is_not_the_layout_is_refused_on_every_rank(llama_dir, capsys, monkeypatch, env, message):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("a group was started"))
    monkeypatch.setattr("baton.serve.server.run", lambda *a, **k: pytest.fail("the server was started"))
    assert main(["serve", "--model", str(llama_dir), "-tp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton serve: error: ") and message in err and err.count("\n") == 1, err
