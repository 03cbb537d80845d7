"""SLURM: a one-node cluster on localhost (launchers/slurm/local_cluster.sh) runs
launchers/train.sbatch for a tiny 2-rank job and launchers/serve.sbatch for its handoff; the
sbatch scripts' commands are also checked in dry-run mode. Two nodes (train.sbatch and
deepspeed.sbatch over two network namespaces) are tests/train/test_two_node.py.

Needs Debian's slurm-wlm daemons and munge, and root ("slurm" in tests/system.py, which names the
apt line): skipped where they are absent, failed instead in CI."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from baton.train.distributed import free_port

from ...system import needs, require

ROOT = Path(__file__).resolve().parents[3]
LAUNCHERS = ROOT / "launchers"
pytestmark = pytest.mark.slow

needs_scontrol = needs("slurm-client")


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))
    }
    return {**env, **extra}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require("slurm")  # the daemons and root (slurmd starts jobs as their users)
    state = tmp_path_factory.mktemp("slurm")
    env = _env(SLURMCTLD_PORT=str(free_port()), SLURMD_PORT=str(free_port()))
    script = str(LAUNCHERS / "slurm" / "local_cluster.sh")
    started = subprocess.run([script, "start", str(state)], env=env, capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield _env(SLURM_CONF=str(state / "slurm.conf"))
    finally:
        subprocess.run([script, "stop", str(state)], env=env, timeout=180)


# `where`: the words that run a client where the controller is reachable (a namespaced cluster's
# first node: tests/train/test_two_node.py); nothing for the localhost cluster.
def submit(env: dict[str, str], args: list[str], where: tuple[str, ...] = (), **extra: str) -> str:
    out = subprocess.run(
        [*where, "sbatch", "--parsable", *args],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job_state(env: dict[str, str], job: str, where: tuple[str, ...] = ()) -> str:
    info = subprocess.run(
        [*where, "scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True
    ).stdout
    m = re.search(r"JobState=(\S+)", info)
    return m.group(1) if m else "UNKNOWN"


def wait_for(env: dict[str, str], job: str, states: set[str], timeout: float, where: tuple[str, ...] = ()) -> str:
    """Poll scontrol (sbatch --wait backs off to tens of seconds) until the job is in `states`."""
    deadline, state = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        state = job_state(env, job, where)
        if state in states:
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job} still {state} after {timeout}s")


DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def test_train_sbatch_runs_two_ranks_and_serve_sbatch_serves_it(cluster, recipe, tmp_path):
    out, log = tmp_path / "run", tmp_path / "train.log"
    job = submit(
        cluster,
        [
            "--nodes=1",
            "--cpus-per-task=2",
            f"--output={log}",
            str(LAUNCHERS / "train.sbatch"),
            "--config",
            str(recipe),
            f"out_dir={out}",
            "max_steps=20",
            "eval_interval=5",
            "backend=torch3d",
            "parallel.tp=2",
        ],
        NPROC_PER_NODE="2",
        RDZV_PORT=str(free_port()),
        BATON_DIR=str(ROOT),
    )
    state = wait_for(cluster, job, DONE, timeout=420)
    text = log.read_text()
    assert state == "COMPLETED", text[-5000:]
    assert "2 rank(s)" in text and (out / "checkpoints" / "step_00000020" / "trainer_state.json").is_file()
    losses = [float(x) for x in re.findall(r"step \d+: train loss ([0-9.]+)", text)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, text[-3000:]

    # serve.sbatch: the handoff the job wrote, sharded over two srun tasks (-tp 2: rank 0 serves,
    # rank 1 is its worker, joined through SLURM's variables), served over gRPC on the node.
    from baton.serve.client import BatonClient
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams

    port, serve_log = free_port(), tmp_path / "serve.log"
    job = submit(
        cluster,
        [
            f"--output={serve_log}",
            "--ntasks=2",
            "--cpus-per-task=1",
            str(LAUNCHERS / "serve.sbatch"),
            "--model",
            str(out / "handoff"),
            "--port",
            str(port),
            "--metrics-port",
            "-1",
            "-tp",
            "2",
            "--num-kv-blocks",
            "64",
        ],
        BATON_DIR=str(ROOT),
        SERVE_HOST="127.0.0.1",
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert job_state(cluster, job) not in DONE, serve_log.read_text()[-3000:]
            try:
                with BatonClient(f"127.0.0.1:{port}", timeout=5) as client:
                    if client.health() == "SERVING":
                        break
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)
        prompt = [5, 6, 7, 8]
        with BatonClient(f"127.0.0.1:{port}", timeout=60) as client:
            served = list(client.complete(prompt, max_tokens=12, temperature=0).completions[0].token_ids)
        with LLM(out / "handoff") as llm:  # the single-process reference
            ref = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12))
        assert served == ref[0].outputs[0].token_ids, (served, ref[0].outputs[0].token_ids)
        assert "2 ranks ready" in serve_log.read_text() and "workers started by the launcher" in serve_log.read_text()
    finally:
        # SIGTERM to the step's tasks (not --full: srun itself would end the step by force): the
        # driver drains and tells its worker to stop; the job completes.
        subprocess.run(["scancel", "--signal=TERM", job], env=cluster, timeout=30)
    assert wait_for(cluster, job, DONE, timeout=60) == "COMPLETED", serve_log.read_text()[-3000:]
    text = serve_log.read_text()
    assert "serving on localhost" in text and "2 rank(s) on 1 node(s)" in text and "rank 1 stopping" in text, text


def dry_conf(tmp_path: Path) -> str:
    """A config for scontrol to expand node lists with (no controller needed)."""
    (tmp_path / "slurm.conf").write_text("ClusterName=dry\nSlurmctldHost=localhost\n")
    return str(tmp_path / "slurm.conf")


def test_deepspeed_sbatch_has_srun_start_one_rank_per_slot(tmp_path):
    """No hostfile, pdsh or ssh: srun starts the job's tasks, each a `baton train` that reads its rank
    from SLURM's variables (run for real over two nodes in tests/train/test_two_node.py)."""
    env = _env(
        SLURM_JOB_NODELIST="node[01-03]",
        SLURM_JOB_NUM_NODES="3",
        SLURM_NTASKS_PER_NODE="4",
        SLURM_CPUS_ON_NODE="16",
        SLURM_JOB_ID="77",
        BATON_DIR=str(ROOT),
        DS_ACCELERATOR="cpu",
        DRY_RUN="1",
    )
    out = subprocess.run(
        [str(LAUNCHERS / "deepspeed.sbatch"), "--config", "c.yaml"], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert "on 3 node(s) x 4 rank(s), started by srun" in out.stdout, out.stdout
    assert "srun --nodes=3 --ntasks-per-node=4 --kill-on-bad-exit=1" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("-m baton.common.cli train --config c.yaml"), out.stdout
    assert "hostfile" not in out.stdout and "deepspeed.sh" not in out.stdout


@needs_scontrol
def test_train_sbatch_rendezvous_on_the_first_node(tmp_path):
    env = _env(
        SLURM_JOB_NODELIST="gpu[7-8]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID="9",
        SLURM_GPUS_ON_NODE="8",
        SLURM_CPUS_PER_TASK="64",
        BATON_DIR=str(ROOT),
        DRY_RUN="1",
        SLURM_CONF=dry_conf(tmp_path),
    )
    out = subprocess.run(
        [str(LAUNCHERS / "train.sbatch"), "--config", "c.yaml", "parallel.tp=8"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    for part in (
        "srun --nodes=2 --ntasks-per-node=1",
        "--nnodes=2 --nproc_per_node=8",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu7:29500",
        "--rdzv_id=9",
        "train --config c.yaml parallel.tp=8",
    ):
        assert part in out.stdout, out.stdout
