"""launchers/torchrun.sh and launchers/deepspeed.sh start real 2-rank runs (gloo on CPU); launchers/serve.sbatch
(dry run) will not serve beyond loopback without a bearer token unless told ALLOW_NO_AUTH=1, and then warns."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from baton.train.distributed import free_port

from .conftest import environment

pytestmark = pytest.mark.slow
LAUNCHERS = Path(__file__).resolve().parents[2] / "launchers"


@pytest.mark.parametrize(
    "launcher, extra",
    [
        ("torchrun.sh", []),
        ("deepspeed.sh", ["backend=deepspeed", "deepspeed.stage=1"]),
    ],
)
def test_launcher_starts_two_ranks(recipe, tmp_path, launcher, extra):
    out = tmp_path / "run"
    env = {k: v for k, v in environment(2).items() if k != "OMP_NUM_THREADS"}  # the launcher sets it
    port = ["--master-port", str(free_port())] if launcher == "deepspeed.sh" else []
    cmd = [
        str(LAUNCHERS / launcher),
        "--nproc",
        "2",
        *port,
        "--",
        "--config",
        str(recipe),
        f"out_dir={out}",
        "max_steps=3",
        "checkpoint.interval=0",
        *extra,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((out / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["layout"]["world_size"] == 2
    assert state["layout"]["backend"] == ("deepspeed" if extra else "torch")
    assert (out / "handoff" / "model.safetensors").is_file()
    assert proc.stdout.count("Trained 3 steps") == 1  # one report, from rank 0


def test_launchers_reject_unknown_options():
    for launcher in ("torchrun.sh", "deepspeed.sh"):
        proc = subprocess.run(
            [str(LAUNCHERS / launcher), "--nodes", "2"], capture_output=True, text=True, env={**os.environ}
        )
        assert proc.returncode == 2 and "unknown option --nodes" in proc.stderr


# ------------------------------------------------------------------------- serve.sbatch and auth
def _serve_sbatch(tmp_path: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    """serve.sbatch in dry-run mode, outside SLURM: a stub scontrol names the node."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "scontrol").write_text("#!/bin/sh\necho node07\n")
    (stub / "scontrol").chmod(0o755)
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k not in ("BATON_AUTH_TOKEN", "ALLOW_NO_AUTH", "SERVE_HOST")
    }
    base.update(
        PATH=f"{stub}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="node07",
        SLURM_JOB_ID="5",
        BATON_DIR=str(LAUNCHERS.parent),
        DRY_RUN="1",
    )
    return subprocess.run(
        [str(LAUNCHERS / "serve.sbatch"), "--model", "m", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(
    "args, env",
    [
        ([], {}),  # the default host, 0.0.0.0
        (["--host", "10.1.2.3"], {"SERVE_HOST": "127.0.0.1"}),  # an argument wins over SERVE_HOST, as in baton serve
        (["--host=::"], {}),
        ([], {"ALLOW_NO_AUTH": "yes"}),  # only exactly 1 opts out
    ],
)
def test_serve_sbatch_refuses_to_serve_the_network_without_a_token(tmp_path, args, env):
    proc = _serve_sbatch(tmp_path, args, **env)
    assert proc.returncode == 2 and "srun" not in proc.stdout, proc.stdout
    assert "refusing to serve" in proc.stderr and "without authentication" in proc.stderr
    for how in ("BATON_AUTH_TOKEN", "--auth-token-file", "SERVE_HOST=127.0.0.1", "ALLOW_NO_AUTH=1"):
        assert how in proc.stderr, how  # the message says how to fix it


def test_serve_sbatch_serves_with_a_token_or_on_loopback(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    for args, env in (
        ([], {"BATON_AUTH_TOKEN": "s3cret"}),
        (["--auth-token-file", str(token)], {}),
        ([f"--auth-token-file={token}"], {}),
        ([], {"SERVE_HOST": "127.0.0.1"}),
        (["--host", "localhost"], {}),
    ):
        proc = _serve_sbatch(tmp_path, args, **env)
        assert proc.returncode == 0, (args, env, proc.stderr)
        assert "baton.common.cli serve --host" in proc.stdout and "WARNING" not in proc.stderr
        assert "s3cret" not in proc.stdout + proc.stderr, "the token must never reach a command line or the log"
    empty = tmp_path / "empty"
    empty.write_text("")
    for bad in (empty, tmp_path / "missing"):
        proc = _serve_sbatch(tmp_path, ["--auth-token-file", str(bad)])
        assert proc.returncode == 2 and "missing or empty" in proc.stderr


def test_serve_sbatch_without_auth_on_purpose_warns_loudly(tmp_path):
    proc = _serve_sbatch(tmp_path, [], ALLOW_NO_AUTH="1")
    assert proc.returncode == 0 and "serve --host 0.0.0.0 --model m" in proc.stdout
    assert "WARNING" in proc.stderr and "WITHOUT AUTHENTICATION" in proc.stderr


def test_serve_sbatch_starts_one_task_per_rank_over_the_nodes(tmp_path):
    loopback = ["--host", "127.0.0.1"]
    proc = _serve_sbatch(tmp_path, [*loopback, "-tp", "2", "--pipeline-parallel-size=2"], SLURM_JOB_NUM_NODES="2")
    assert proc.returncode == 0, proc.stderr
    assert "srun --nodes=2 --ntasks=4 --ntasks-per-node=2 --kill-on-bad-exit=1 " in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith(
        "serve --host 0.0.0.0 --model m --host 127.0.0.1 -tp 2 --pipeline-parallel-size=2"
    )
    assert "4 rank(s) on 2 node(s)" in proc.stdout
    one = _serve_sbatch(tmp_path, loopback)  # unsharded: one task, as before
    assert one.returncode == 0 and "srun --nodes=1 --ntasks=1 --ntasks-per-node=1 " in one.stdout, one.stderr
    for args, env, message in (
        (
            ["-tp", "2"],
            {"SLURM_NTASKS": "1"},
            "needs 2 tasks but the job has 1: submit with sbatch --nodes=1 --ntasks-per-node=2",
        ),
        (
            ["-tp=4"],
            {"SLURM_JOB_NUM_NODES": "3"},
            "4 ranks (-tp 4 x -pp 1) do not spread evenly over the job's 3 nodes",
        ),
        (["-pp", "two"], {}, "-tp/-pp must be positive integers, got 'two'"),
        (["--nodes", "2"], {}, "give the node count to sbatch, before the script: sbatch --nodes=N"),
    ):
        proc = _serve_sbatch(tmp_path, [*loopback, *args], **env)
        assert proc.returncode == 2 and message in proc.stderr and "srun" not in proc.stdout, (args, proc.stderr)
