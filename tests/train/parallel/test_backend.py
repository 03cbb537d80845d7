"""backend: torch3d through the real `baton train` (torchrun on loopback): the same loss curve as
one plain process, DCP checkpoints that resume at another layout or backend, the handoff export,
and layouts rejected from the recipe before any process group starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from baton.train.backends.readers import read_any

from ..conftest import environment, losses, run, train_args

pytestmark = pytest.mark.slow
TORCH3D = ["backend=torch3d"]


@pytest.fixture(scope="module")
def trained(recipe, runs, tmp_path_factory):
    """name -> out_dir: the single-process reference (the session's torch-1 run of the same recipe)
    and two torch3d layouts."""
    root = tmp_path_factory.mktemp("torch3d")
    layouts = {
        "tp2_pp2": (4, [*TORCH3D, "parallel.tp=2", "parallel.pp=2"]),
        "cp2_selective": (2, [*TORCH3D, "parallel.cp=2", "recompute.mode=selective"]),
    }
    for name, (nproc, overrides) in layouts.items():
        run(nproc, train_args(recipe, root / name, overrides), root / f"{name}.log")
    return {"single": runs.get("torch-1"), **{name: root / name for name in layouts}}


@pytest.mark.parametrize("layout", ["tp2_pp2", "cp2_selective"])
def test_trainer_loss_curve_matches_single_process(trained, layout):
    reference, other = losses(trained["single"]), losses(trained[layout])
    assert len(other) == len(reference) == 20 and reference[-1] < reference[0] - 0.5
    rel = [abs(a - b) / b for a, b in zip(other, reference)]
    assert max(rel) < 1e-5, rel
    # Evaluation (forward only: the pipeline walked stage by stage, ring attention without backward).
    ref_val, val = val_losses(trained["single"]), val_losses(trained[layout])
    assert len(val) == len(ref_val) == 2 and max(abs(a - b) / b for a, b in zip(val, ref_val)) < 1e-5


def val_losses(out_dir) -> list[float]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if r.get("val_loss") is not None]


@pytest.mark.parametrize(
    "nproc, overrides", [(1, ["backend=torch"]), (2, [*TORCH3D, "parallel.dp=2"])], ids=["torch-1", "torch3d-dp2"]
)
def test_resume_tp2_pp2_checkpoint_at_another_layout(trained, recipe, tmp_path, nproc, overrides):
    """Step 10 of the TP=2 x PP=2 run, continued on one plain process (the DCP shards read as whole
    tensors) and by FSDP over 2 ranks (re-sharded): steps 11-20 as if it had never stopped."""
    ckpt = trained["tp2_pp2"] / "checkpoints" / "step_00000010"
    out = tmp_path / "resumed"
    run(nproc, train_args(recipe, out, [*overrides, f"checkpoint.resume={ckpt}"]), tmp_path / "resume.log")
    continued, uninterrupted = losses(out), losses(trained["tp2_pp2"])[10:]
    assert len(continued) == 10
    rel = [abs(a - b) / b for a, b in zip(continued, uninterrupted)]
    assert max(rel) < 1e-5, rel


def test_handoff_of_a_torch3d_run(trained, tmp_path):
    run_dir = trained["tp2_pp2"]
    meta = json.loads((run_dir / "handoff" / "baton.json").read_text())
    assert meta["parallel_layout"] == {"dp": 1, "pp": 2, "cp": 1, "tp": 2} and meta["step"] == 20
    # `baton export` later, from the DCP checkpoint, gives the same files' tensors.
    out = subprocess.run(
        [sys.executable, "-m", "baton.common.cli", "export", str(run_dir), str(tmp_path / "h")],
        env=environment(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    from baton.common.checkpoint import load_state_dict

    exported = load_state_dict(tmp_path / "h")
    weights = read_any(run_dir / "checkpoints" / "step_00000020", "torch3d", with_optimizer=False).weights
    assert exported.keys() <= weights.keys() and all((exported[k] == weights[k]).all() for k in exported)


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        ("1", [*TORCH3D, "parallel.tp=3"], "world size 1 is not divisible by tp x pp x cp = 3 x 1 x 1 = 3"),
        ("4", [*TORCH3D, "parallel.pp=4"], "4 pipeline stages (pp=4 x pp_stages_per_rank=1) but only 2 layers"),
        (
            "2",
            [*TORCH3D, "parallel.pp=2", "global_batch_size=4"],
            "1f1b needs at least as many micro-batches per step as pipeline ranks: 1 micro-batches < pp=2",
        ),
        ("1", ["parallel.tp=2"], "the parallel section needs backend: torch3d or megatron"),
    ],
)
def test_recipe_with_impossible_layout_fails_before_starting(
    recipe, tmp_path, world, overrides, message, monkeypatch, capsys
):
    """WORLD_SIZE is what torchrun sets before starting the ranks: the recipe is checked against it
    when it is loaded, before any process group, tokenizer or weight exists. (`baton train` in this
    process: it fails before anything a second process would isolate is made.)"""
    from baton.common.cli import main as baton

    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", world)
    code, stderr = baton(train_args(recipe, tmp_path / "run", overrides)), capsys.readouterr().err
    assert code == 2 and message in stderr, stderr[-2000:]
    assert not (tmp_path / "run").exists()
