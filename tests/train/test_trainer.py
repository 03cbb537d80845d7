"""The training loop in one process (plain PyTorch): schedule, data order, determinism,
checkpoint rotation and atomicity, non-finite losses, logs and plots."""

import json
import math

import datasets
import pytest
import torch
import yaml

from baton.train import checkpointing
from baton.train.backends import ddp
from baton.train.batches import DataPosition, GlobalBatches, micro_batches
from baton.train.recipe import config_from_dict
from baton.train.schedule import lr_at
from baton.train.trainer import TrainingDiverged, train
from baton.train.universal import read_universal

from .conftest import TINY


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cfg_for(recipe, tmp_path, one_thread):
    raw = yaml.safe_load(recipe.read_text())

    def make(*overrides: str, out: str = "run"):
        return config_from_dict(raw, [f"out_dir={tmp_path / out}", *overrides])

    return make


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    cfg = config_from_dict(TINY, ["max_steps=110", "optim.warmup_steps=10", "optim.lr=1.0", "optim.min_lr=0.1"])
    assert [lr_at(s, cfg) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1) and lr_at(500, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize("world_size, accum", [(1, 4), (2, 2), (4, 1)])
def test_each_rank_takes_disjoint_micro_batches_covering_the_global_batch(world_size, accum):
    batch = torch.arange(16 * 3).view(16, 3)
    parts = [mb for r in range(world_size) for mb in micro_batches(batch, 4, accum, r, world_size)]
    assert all(mb.shape == (4, 3) for mb in parts)
    assert sorted(torch.cat(parts)[:, 0].tolist()) == batch[:, 0].tolist()


def test_global_batches_resume_from_a_position_and_skip_short_epoch_tails():
    ds = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(10)]})
    stream = GlobalBatches(ds, 4, seed=3)
    first = [stream.next() for _ in range(5)]  # 2 full batches per epoch of 10, tail of 2 skipped
    assert stream.state_dict() == {"epoch": 2, "index": 4}
    epoch0 = torch.cat(first[:2])[:, 0].tolist()
    assert len(set(epoch0)) == 8 and epoch0 != sorted(epoch0)  # distinct samples, shuffled
    resumed = GlobalBatches(ds, 4, seed=3, position=DataPosition(epoch=1, index=4))
    assert torch.equal(resumed.next(), first[3]) and torch.equal(resumed.next(), first[4])


def test_same_seed_same_run_other_seed_other_run(cfg_for):
    a = train(cfg_for("max_steps=6", "export=false", out="a"))
    b = train(cfg_for("max_steps=6", "export=false", out="b"))
    c = train(cfg_for("max_steps=6", "export=false", "seed=7", out="c"))
    losses = [
        [r["loss"] for r in map(json.loads, (p.parent.parent / "metrics.jsonl").read_text().splitlines())]
        for p in (a.checkpoint_dir, b.checkpoint_dir, c.checkpoint_dir)
    ]
    assert losses[0] == losses[1] != losses[2]


def test_keeps_the_last_k_checkpoints_and_resumes_past_the_end_without_training(cfg_for, tmp_path):
    cfg = cfg_for("max_steps=12", "checkpoint.interval=3", "checkpoint.keep_last=2")
    result = train(cfg)
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpointing.list_checkpoints(root)] == ["step_00000009", "step_00000012"]
    again = train(cfg)  # resume: auto finds step 12 = max_steps, nothing left to do
    assert again.steps == 12 and again.checkpoint_dir == result.checkpoint_dir


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_intact(cfg_for, tmp_path, monkeypatch):
    real_save = ddp.DDPBackend.save
    calls = []

    def dying_save(self, directory):
        calls.append(directory)
        if len(calls) == 2:  # the step-8 save: write part of it, then die
            (directory / "model.safetensors").write_bytes(b"partial")
            raise KeyboardInterrupt("killed during save")
        real_save(self, directory)

    monkeypatch.setattr(ddp.DDPBackend, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        train(cfg_for("max_steps=12", "checkpoint.interval=4"))
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step_00000004"]  # no partial step_8, no temp dir left
    state = read_universal(root / "step_00000004")
    assert state.step == 4 and checkpointing.read_state(root / "step_00000004")["step"] == 4
    monkeypatch.setattr(ddp.DDPBackend, "save", real_save)
    assert train(cfg_for("max_steps=12", "checkpoint.interval=4")).steps == 12  # resumes from step 4


def poison(monkeypatch, bad_steps: set[int], calls_per_step: int = 2):
    """Make the loss (and so every gradient) NaN in the given 1-based steps."""
    real = ddp.lm_loss
    count = {"n": 0}

    def lm_loss(logits, batch):
        count["n"] += 1
        loss = real(logits, batch)
        return loss * math.nan if (count["n"] - 1) // calls_per_step + 1 in bad_steps else loss

    monkeypatch.setattr(ddp, "lm_loss", lm_loss)


def test_non_finite_steps_are_skipped_and_leave_the_weights_alone(cfg_for, monkeypatch, caplog):
    poison(monkeypatch, {3, 4})
    seen = []
    real_step = ddp.DDPBackend.train_step

    def train_step(self, micro_batches, lr):
        before = [p.detach().clone() for p in self.module.parameters()]
        result = real_step(self, micro_batches, lr)
        seen.append((result.applied, all(torch.equal(a, p) for a, p in zip(before, self.module.parameters()))))
        return result

    monkeypatch.setattr(ddp.DDPBackend, "train_step", train_step)
    result = train(cfg_for("max_steps=8", "max_nan_steps=3", "export=false"))
    assert result.skipped_steps == 2 and math.isfinite(result.final_train_loss)
    assert seen[2] == seen[3] == (False, True)  # steps 3, 4: skipped, weights untouched
    assert all(applied and not same for applied, same in seen[:2] + seen[4:])
    assert "non-finite loss" in caplog.text
    records = [
        json.loads(line) for line in (result.checkpoint_dir.parent.parent / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records if r["skipped"]] == [3, 4]


def test_too_many_non_finite_steps_in_a_row_stop_with_the_last_good_checkpoint(cfg_for, monkeypatch, tmp_path):
    poison(monkeypatch, set(range(7, 100)))
    with pytest.raises(TrainingDiverged, match="3 non-finite steps in a row at step 9.*step_00000005"):
        train(cfg_for("max_steps=20", "max_nan_steps=3", "checkpoint.interval=5"))
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpointing.list_checkpoints(root)] == ["step_00000005"]
    state = read_universal(root / "step_00000005")
    assert all(torch.isfinite(t).all() for t in state.weights.values())
    assert not (tmp_path / "run" / "handoff").exists()


def test_logs_tensorboard_plot_and_mfu(cfg_for, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(
        cfg_for(
            "max_steps=10",
            "logging.plot=true",
            "logging.tensorboard=true",
            "logging.mfu=true",
            "log_interval=2",
            "eval_interval=5",
        )
    )
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 5, 6, 8, 10]
    assert [r["step"] for r in records if "val_loss" in r] == [5, 10]
    assert all(0 < r["mfu"] < 1 and r["tokens_per_s"] > 0 and r["lr"] > 0 for r in records)
    header = (run / "metrics.csv").read_text().splitlines()[0]
    assert header == "step,loss,val_loss,lr,grad_norm,tokens_per_s,mfu,skipped,elapsed_s"
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 5, 6, 8, 10]
    assert [e.step for e in events.Scalars("val/loss")] == [5, 10]
