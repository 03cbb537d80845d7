"""Kill-and-resume: a run SIGKILLed mid-run (a real process group, killed right after its step-10
checkpoint) and resumed reaches the same weights as the uninterrupted reference run, for every
backend, ZeRO stage and offload mode; and a checkpoint resumes at another world size.

Each killed run is its own process group; the resumes (like the reference runs) are made one
world size at a time in one process group (multi_run.py), each with its own out_dir and recipe."""

import json
from pathlib import Path

import pytest
import torch

from .conftest import CKPT_STEP, MODES, STEPS, final_state, losses, max_rel_diff, multi_run, run_and_kill, train_args

pytestmark = pytest.mark.slow

KILLED = ["torch-1", "ddp-2", "z0-2", "z1-2", "z2-2", "z3-2", "z2-offload-2", "z3-offload-cpuadam-2"]
ANOTHER_WORLD_SIZE = [
    ("ddp-2", "torch-1"),  # 2 -> 1, plain PyTorch
    ("z1-2", "z1-1"),  # 2 -> 1: ZeRO-1/2 have no DeepSpeed conversion at all
    ("z2-2", "z2-1"),
    ("z3-2", "z3-1"),
    ("z2-1", "z2-2"),  # 1 -> 2
    ("z3-1", "z3-2"),
    ("z3-offload-cpuadam-2", "torch-1"),  # any layout to any other, DeepSpeedCPUAdam state included
]


def marker(out: Path) -> Path:
    return out / "checkpoints" / f"step_{CKPT_STEP:08d}" / "trainer_state.json"


@pytest.fixture(scope="module")
def resumed(runs, tmp_path_factory) -> Path:
    """ROOT/killed-MODE: killed after step 10, then resumed (checkpoint.resume: auto); ROOT/SOURCE-to-
    TARGET: the step-10 checkpoint of SOURCE's reference resumed at TARGET's layout. The resume logs
    are ROOT/resumed-N.log (N ranks)."""
    root = tmp_path_factory.mktemp("resumed")
    todo: dict[int, dict[str, list[str]]] = {}
    for mode in KILLED:
        nproc, overrides = MODES[mode]
        out = root / f"killed-{mode}"
        run_and_kill(nproc, train_args(runs.recipe, out, overrides), marker(out), root / f"killed-{mode}.log")
        assert not (out / "checkpoints" / f"step_{STEPS:08d}").exists(), (
            f"{mode}: the run finished before it was killed"
        )
        todo.setdefault(nproc, {})[out.name] = overrides
    for source, target in ANOTHER_WORLD_SIZE:
        ckpt = runs.get(source) / "checkpoints" / f"step_{CKPT_STEP:08d}"
        nproc, overrides = MODES[target]
        todo.setdefault(nproc, {})[f"{source}-to-{target}"] = [*overrides, f"checkpoint.resume={ckpt}"]
    for nproc, batch in todo.items():
        multi_run(nproc, runs.recipe, root, batch, f"resumed-{nproc}.log")
    return root


@pytest.mark.parametrize("mode", KILLED)
def test_killed_run_resumes_to_the_same_weights(runs, resumed, mode):
    reference, out = runs.get(mode), resumed / f"killed-{mode}"
    log = (resumed / f"resumed-{MODES[mode][0]}.log").read_text()
    assert f"resumed from {marker(out).parent}" in log  # checkpoint.resume: auto picked up step 10
    got, want = final_state(out), final_state(reference)
    assert got.step == want.step == STEPS
    if mode in ("torch-1", "ddp-2"):  # plain PyTorch, fp32: bit-identical
        for name in want.weights:
            assert torch.equal(got.weights[name], want.weights[name]), name
            assert torch.equal(got.exp_avg_sq[name], want.exp_avg_sq[name]), name
        assert losses(out) == losses(reference)
    else:
        for key in ("weights", "exp_avg", "exp_avg_sq"):
            assert max_rel_diff(getattr(got, key), getattr(want, key)) <= 1e-6, key
        assert max(abs(a - b) / abs(b) for a, b in zip(losses(out), losses(reference))) <= 1e-6
    assert len(losses(out)) == STEPS  # the log was cut back to the checkpoint, not duplicated


@pytest.mark.parametrize("source, target", ANOTHER_WORLD_SIZE)
def test_resume_at_another_world_size(runs, resumed, source, target):
    reference, out = runs.get(source), resumed / f"{source}-to-{target}"
    nproc = MODES[target][0]
    state = json.loads((out / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json").read_text())
    assert (
        state["layout"]["world_size"] == nproc
        and state["data"]
        == json.loads((reference / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json").read_text())["data"]
    )
    got, want = final_state(out), final_state(reference)
    for key in ("weights", "exp_avg", "exp_avg_sq"):
        assert max_rel_diff(getattr(got, key), getattr(want, key)) < 1e-5, key
    resumed = losses(out)  # a fresh out_dir: only the resumed steps are logged
    assert len(resumed) == STEPS - CKPT_STEP
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, losses(reference)[CKPT_STEP:])) < 1e-5
