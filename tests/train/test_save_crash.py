"""A run SIGKILLed while it is writing a checkpoint's shards: the previous checkpoint is intact and
loads, the half-written one is ignored (it never left its hidden staging directory), and the run
resumes from the previous one and goes on to the same losses.

The kill must land inside the write, not before or after it, whatever the machine's load, so the
killed run's ranks run this file as their entry point: each rank that has just written a file
matching $BATON_TEST_PAUSE_WRITE (a file name pattern inside the new step's staging directory)
says so in $BATON_TEST_PAUSE_MARKERS and stops there. The test waits for those markers, checks
that the staging directory exists with some shards still missing and no final directory, then
kills every process of the run at once. Everything else is the real trainer and the real save.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import time
from pathlib import Path

PAUSE = "BATON_TEST_PAUSE_WRITE"
MARKERS = "BATON_TEST_PAUSE_MARKERS"


def _pause_after_matching_writes() -> None:
    """Wrap the writers every checkpoint file goes through (torch.save: DeepSpeed's shards;
    safetensors: Baton's), before baton imports them, so a rank stops right after a matching one."""
    import safetensors.torch
    import torch

    pattern, markers = "*/" + os.environ[PAUSE], Path(os.environ[MARKERS])

    def wrap(write):
        def paused(obj, path, *args, **kwargs):
            out = write(obj, path, *args, **kwargs)
            if isinstance(path, (str, os.PathLike)) and fnmatch.fnmatch(os.fspath(path), pattern):
                rank = os.environ.get("RANK", "0")
                (markers / f".rank{rank}").write_text(os.fspath(path))
                os.replace(markers / f".rank{rank}", markers / f"rank{rank}")  # whole, or not there
                time.sleep(300)  # the test kills us here; should it not, the run goes on and the test fails
            return out

        return paused

    torch.save = wrap(torch.save)
    safetensors.torch.save_file = wrap(safetensors.torch.save_file)


if __name__ == "__main__":  # a rank of the run to be killed (see the module docstring)
    _pause_after_matching_writes()
    from baton.common.cli import main

    sys.exit(main(sys.argv[1:]))

import psutil  # noqa: E402  (the worker above needs none of the test's imports)
import pytest  # noqa: E402

from baton.common.cli import main as baton  # noqa: E402
from baton.train.backends.readers import read_any  # noqa: E402
from baton.train.checkpointing import STATE_FILE, list_checkpoints, read_state  # noqa: E402

from .conftest import CKPT_STEP, MODES, STEPS, command, environment, kill_tree, losses, train_args  # noqa: E402

pytestmark = pytest.mark.slow

STAGING = f".step_{STEPS:08d}.tmp-*"  # atomic_directory's hidden temporary sibling of step_00000020


def run_until_paused(
    nproc: int, args: list[str], pause_after: str, writers: int, markers: Path, log: Path, timeout: float = 240
) -> subprocess.Popen:
    """Start the run with the write hook and return once `writers` ranks have stopped after
    writing a `pause_after` file into the new checkpoint's staging directory (still running)."""
    env = {**environment(nproc), PAUSE: f"{STAGING}/{pause_after}", MARKERS: str(markers)}
    with open(log, "w") as f:
        proc = subprocess.Popen(command(nproc, args, script=__file__), env=env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while len(list(markers.glob("rank*"))) < writers:
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended ({proc.returncode}) before it paused in its save:\n{log.read_text()[-6000:]}"
            )
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            raise AssertionError(f"timed out waiting for {writers} ranks to write {pause_after}")
        time.sleep(0.02)
    return proc


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE  # a zombie is dead, not yet reaped
    except psutil.NoSuchProcess:
        return False


# mode -> (file each writing rank stops after, how many ranks write one, a shard still unwritten then)
CASES = {
    # Plain PyTorch: rank 0 writes the whole model, then the optimizer state (train/universal.py).
    "ddp-2": ("model.safetensors", 1, "optimizer.safetensors"),
    # DeepSpeed ZeRO-3: every rank writes its model-state file, then its optimizer partition.
    "z3-2": ("zero/zero_pp_rank_*_model_states.pt", 2, "zero/zero_pp_rank_*_optim_states.pt"),
}


@pytest.mark.parametrize("mode", list(CASES))
def test_run_killed_while_writing_shards_resumes_from_the_previous_checkpoint(recipe, mode, tmp_path):
    nproc, overrides = MODES[mode]
    pause_after, writers, unwritten = CASES[mode]
    out, markers = tmp_path / "run", tmp_path / "markers"
    root, previous, new = out / "checkpoints", out / "checkpoints" / f"step_{CKPT_STEP:08d}", f"step_{STEPS:08d}"
    markers.mkdir()
    args = train_args(recipe, out, overrides)

    proc = run_until_paused(nproc, args, pause_after, writers, markers, tmp_path / "killed.log")
    try:  # the moment of the kill: the new checkpoint is half written, in its staging directory only
        staging = list(root.glob(STAGING))
        assert len(staging) == 1 and proc.poll() is None, (staging, proc.returncode)
        assert not (root / new).exists(), "the new checkpoint was already in place"
        assert list(staging[0].glob(pause_after)) and not list(staging[0].glob(unwritten)), sorted(
            p.relative_to(staging[0]).as_posix() for p in staging[0].rglob("*")
        )
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(tree) > nproc, "torchrun and its workers are not all running"
    finally:
        kill_tree(proc.pid)  # SIGKILL, to every process at once (psutil reaps them: no exit status is left)
        proc.wait()
    assert not any(alive(p) for p in tree), "some process of the run survived the kill"
    # What the kill left: the partial staging directory, never renamed, and the intact previous step.
    assert staging[0].is_dir() and not (staging[0] / STATE_FILE).exists() and not (root / new).exists()
    assert list_checkpoints(root) == [previous]
    killed_losses = losses(out)
    assert len(killed_losses) == STEPS  # it had trained (and logged) step 20 before saving it

    # The previous checkpoint verifies and loads whole.
    assert baton(["info", str(previous), "--verify"]) == 0
    state = read_state(previous)
    assert state["step"] == CKPT_STEP
    loaded = read_any(previous, state["layout"]["backend"])
    assert loaded.step == CKPT_STEP and loaded.weights.keys() == loaded.exp_avg.keys() == loaded.exp_avg_sq.keys()
    assert all(t.isfinite().all() for d in (loaded.weights, loaded.exp_avg, loaded.exp_avg_sq) for t in d.values())

    # The same command resumes from it, writes step 20 properly this time and clears the leftover.
    log = tmp_path / "resumed.log"
    with open(log, "w") as f:
        done = subprocess.run(
            command(nproc, args), env=environment(nproc), stdout=f, stderr=subprocess.STDOUT, timeout=240
        )
    assert done.returncode == 0, log.read_text()[-6000:]
    assert f"resumed from {previous}" in log.read_text()
    assert list_checkpoints(root) == [previous, root / new] and not list(root.glob(STAGING))
    assert read_state(root / new)["step"] == STEPS
    resumed = losses(out)  # steps 1-10 kept from the killed run, 11-20 trained again
    assert len(resumed) == STEPS
    if mode == "ddp-2":  # plain PyTorch, fp32: the killed run's own losses, bit for bit
        assert resumed == killed_losses
    else:
        assert max(abs(a - b) / abs(b) for a, b in zip(resumed, killed_losses)) <= 1e-6
