"""`srun -n N baton train` (no torchrun) is one N-rank job formed from SLURM's variables, or a clear
refusal; never N single-rank runs writing into one out_dir. No SLURM needed: the tasks are
subprocesses with the variables srun gives its tasks."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import pytest

from baton.common.cli import main
from baton.common.launch import first_host, read_launch, slurm_port

from .conftest import environment, train_args

SRUN = {"SLURM_STEP_ID": "0", "SLURM_NODELIST": "127.0.0.1", "SLURM_STEP_NODELIST": "127.0.0.1"}


def _free_slurm_port() -> tuple[int, int]:
    """A job id whose derived rendezvous port is free right now."""
    for _ in range(100):
        job = random.randrange(1, 10**6)
        port = slurm_port(job)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job, port
    raise AssertionError("no free port")


def srun_env(procid: int, ntasks: int, job: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in environment(ntasks).items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC"))}
    return {
        **env,
        **SRUN,
        "SLURM_JOB_ID": str(job),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid),
        **extra,
    }


def test_srun_tasks_form_one_job(recipe, tmp_path):
    job, _ = _free_slurm_port()
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "baton.common.cli",
        *train_args(recipe, out, ["max_steps=4", "eval_interval=0", "export=false", "checkpoint.interval=0"]),
    ]
    logs = [tmp_path / f"task{i}.log" for i in range(2)]
    procs = [
        subprocess.Popen(args, env=srun_env(i, 2, job), stdout=open(logs[i], "w"), stderr=subprocess.STDOUT)
        for i in range(2)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n---\n".join(t[-3000:] for t in text)
    assert "world size 2" in text[0] and "Trained 4 steps" in text[0]  # one report, by rank 0
    assert "world size" not in text[1] and "Trained" not in text[1]
    ckpts = sorted((out / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step_00000004"]
    state = json.loads((ckpts[0] / "trainer_state.json").read_text())
    assert state["layout"]["world_size"] == 2 and state["global_batch"] == 8
    assert sorted(p.name for p in ckpts[0].glob("rng_rank*")) == ["rng_rank0.safetensors", "rng_rank1.safetensors"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4  # one log, not one per task


@pytest.fixture
def slurm(monkeypatch):
    """Set this process's environment as srun would for task `procid` of `ntasks` (plus `extra`)."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC")) or key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            monkeypatch.delenv(key)

    def setup(procid: int = 1, ntasks: int = 2, drop: tuple[str, ...] = (), **extra: str) -> None:
        env = {
            **SRUN,
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": str(ntasks),
            "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": str(procid),
            **extra,
        }
        for key, value in env.items():
            if key not in drop:
                monkeypatch.setenv(key, value)

    return setup


@pytest.mark.parametrize(
    "setup, message",
    [
        # RANK/WORLD_SIZE exported by hand: each task would be rank 0 of its own 1-rank job
        (
            dict(RANK="0", WORLD_SIZE="1"),
            "srun started 2 tasks (SLURM_NTASKS=2; this is SLURM_PROCID=1) but RANK=0 and WORLD_SIZE=1 are set",
        ),
        (dict(RANK="1", WORLD_SIZE="4"), "RANK=1 and WORLD_SIZE=4 are set, which would not make one job"),
        # srun -n 2 torchrun --standalone --nproc_per_node 2: two 2-rank jobs
        (
            dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="x"),
            "each a launcher of 2 ranks, but WORLD_SIZE is 2, not 2 x 2",
        ),
        (dict(drop=("SLURM_LOCALID",)), "SLURM_LOCALID (its rank on the node)"),
        (dict(drop=("SLURM_JOB_ID",)), "SLURM_JOB_ID (for the rendezvous port, or set MASTER_PORT)"),
        (
            dict(drop=("SLURM_NODELIST", "SLURM_STEP_NODELIST")),
            "SLURM_NODELIST (for the first node, or set MASTER_ADDR)",
        ),
        (dict(procid=2), "SLURM_PROCID=2 is not a rank of SLURM_NTASKS=2"),
        # the batch script itself (no srun): one process of a 2-task allocation
        (dict(procid=0, drop=("SLURM_STEP_ID",)), "SLURM_NTASKS=2 but this process is not an srun task"),
    ],
)
def test_an_inconsistent_srun_launch_is_refused(recipe, tmp_path, capsys, slurm, monkeypatch, setup, message):
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("a group was started"))
    slurm(**setup)
    out = tmp_path / "run"
    assert main(["train", "--config", str(recipe), f"out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("baton train: error:") and err.count("\n") == 1, err
    assert not out.exists()


def test_launches_that_are_one_job(slurm):
    slurm(procid=1, ntasks=2, SLURM_NODELIST="gpu[07-09],cpu1", SLURM_STEP_NODELIST="gpu[07-09]")
    got = read_launch()
    assert (got.rank, got.world_size, got.local_rank, got.source) == (1, 2, 1, "slurm")
    assert got.env == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(slurm_port(4242, 0)),
    }
    # launchers/train.sbatch: one torchrun per srun task, joined by --nnodes into one job
    slurm(procid=0, RANK="3", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="4242", MASTER_PORT="29500")
    assert (read_launch().rank, read_launch().world_size, read_launch().source) == (3, 4, "launcher")
    assert read_launch({"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}).source == "single"
    assert read_launch({"SLURM_NTASKS": "4"}).source == "single"  # salloc's shell: no task of a step


def test_slurm_hostlists_and_ports():
    assert first_host("gpu[007-009,12],cpu1") == "gpu007" and first_host("n1,n2") == "n1"
    assert first_host("rack[2-3]-n[10-11]") == "rack2-n10" and first_host("127.0.0.1") == "127.0.0.1"
    assert slurm_port(5, 0) != slurm_port(5, 1) != slurm_port(6, 0)
    assert all(10000 <= slurm_port(j, s) < 30000 for j in (0, 1, 123456789) for s in (0, 3))
