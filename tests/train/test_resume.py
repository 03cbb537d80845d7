"""Kill-and-resume: a run SIGKILLed mid-run (a real process group, killed right after its step-10
checkpoint) and resumed reaches the same weights as the uninterrupted reference run, for every
backend, ZeRO stage and offload mode; and a checkpoint resumes at another world size."""

import json

import pytest
import torch

from .conftest import CKPT_STEP, MODES, STEPS, final_state, losses, max_rel_diff, run, run_and_kill, train_args

pytestmark = pytest.mark.slow

KILLED = ["torch-1", "ddp-2", "z0-2", "z1-2", "z2-2", "z3-2", "z2-offload-2", "z3-offload-cpuadam-2"]


@pytest.mark.parametrize("mode", KILLED)
def test_killed_run_resumes_to_the_same_weights(runs, mode, tmp_path):
    reference = runs.get(mode)
    nproc, overrides = MODES[mode]
    out = tmp_path / "run"
    args = train_args(runs.recipe, out, overrides)
    marker = out / "checkpoints" / f"step_{CKPT_STEP:08d}" / "trainer_state.json"
    run_and_kill(nproc, args, marker, tmp_path / "killed.log")
    assert not (out / "checkpoints" / f"step_{STEPS:08d}").exists(), "the run finished before it was killed"

    run(nproc, args, tmp_path / "resumed.log")  # checkpoint.resume: auto picks up step 10
    assert f"resumed from {marker.parent}" in (tmp_path / "resumed.log").read_text()
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


@pytest.mark.parametrize(
    "source, target",
    [
        ("ddp-2", "torch-1"),  # 2 -> 1, plain PyTorch
        ("z1-2", "z1-1"),  # 2 -> 1: ZeRO-1/2 have no DeepSpeed conversion at all
        ("z2-2", "z2-1"),
        ("z3-2", "z3-1"),
        ("z2-1", "z2-2"),  # 1 -> 2
        ("z3-1", "z3-2"),
        ("z3-offload-cpuadam-2", "torch-1"),  # any layout to any other, DeepSpeedCPUAdam state included
    ],
)
def test_resume_at_another_world_size(runs, source, target, tmp_path):
    reference = runs.get(source)
    ckpt = reference / "checkpoints" / f"step_{CKPT_STEP:08d}"
    nproc, overrides = MODES[target]
    out = tmp_path / "run"
    run(nproc, train_args(runs.recipe, out, [*overrides, f"checkpoint.resume={ckpt}"]), tmp_path / "resumed.log")
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
