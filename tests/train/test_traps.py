"""The trainer refuses every trap before any process group starts: pass-throughs (deepspeed.extra,
the model section) that would change what the recipe says, and resuming on other inputs than the
checkpoint was trained on. Each refusal is exit code 2 and one line naming the key, and leaves no
output folder (or no new checkpoint) behind."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch.distributed
import yaml

from baton.common.cli import main
from baton.common.tokenizer import train_char

from .conftest import TINY


@pytest.fixture
def no_process_group(monkeypatch):
    """Any attempt to make a process group fails the test (as an unexpected error, not exit 2)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process group was started")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)
    yield
    assert not torch.distributed.is_initialized()


DS = ["backend=deepspeed"]
X, E = "deepspeed.extra=", "deepspeed.extra."  # an extra override; the start of a refused key's name
NVME = "{zero_optimization: {offload_optimizer: {device: nvme, nvme_path: /tmp}}}"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            [*DS, X + "{zero_optimization: {stage: 3}}"],
            E + "zero_optimization.stage=3 disagrees with deepspeed.stage=0",
        ),
        (
            [*DS, "deepspeed.stage=2", X + NVME],
            E + "zero_optimization.offload_optimizer.device: nvme needs ZeRO stage 3; "
            "at stage 1/2 DeepSpeed silently offloads to CPU memory",
        ),
        (
            [*DS, "deepspeed.stage=1", X + NVME],
            E + "zero_optimization.offload_optimizer.device: nvme needs ZeRO stage 3",
        ),
        (
            [*DS, "deepspeed.stage=2", X + "{zero_optimization: {offload_optimizer: {device: cpu}}}"],
            E + "zero_optimization.offload_optimizer.device='cpu' disagrees with deepspeed.offload_optimizer='none'",
        ),
        (
            [*DS, "deepspeed.stage=3", X + "{zero_optimization: {offload_param: {device: cpu}}}"],
            E + "zero_optimization.offload_param.device='cpu' disagrees with deepspeed.offload_param='none'",
        ),
        ([*DS, X + "{zero_optimization: true}"], E + "zero_optimization must be a mapping"),
        ([*DS, X + "{zero_optimization: {cpu_offload: true}}"], E + "zero_optimization.cpu_offload: old spellings"),
        (
            [*DS, X + "{train_micro_batch_size_per_gpu: 2}"],
            E + "train_micro_batch_size_per_gpu=2 disagrees with micro_batch_size=4",
        ),
        (
            [*DS, X + "{gradient_accumulation_steps: 1}"],
            E + "gradient_accumulation_steps=1 disagrees with the recipe's 2 accumulation steps",
        ),
        ([*DS, X + "{train_batch_size: 16}"], E + "train_batch_size=16 disagrees with the recipe's global batch of 8"),
        ([*DS, X + "{gradient_clipping: 0.5}"], E + "gradient_clipping=0.5 disagrees with optim.grad_clip"),
        ([*DS, X + "{bf16: {enabled: true}}"], E + "bf16.enabled=True disagrees with the recipe's dtype"),
        ([*DS, X + "{fp16: {enabled: true}}"], E + "fp16.enabled=True disagrees with the recipe's dtype"),
        ([*DS, X + "{bfloat16: {enabled: true}}"], E + "bfloat16.enabled=True disagrees"),
        ([*DS, X + "{torch_autocast: {enabled: true}}"], E + "torch_autocast.enabled=True disagrees"),
        ([*DS, X + "{communication_data_type: fp16}"], E + "communication_data_type='fp16'"),
        ([*DS, X + "{optimizer: {type: Adam}}"], E + "optimizer is not allowed"),
        ([*DS, X + "{scheduler: {type: WarmupLR}}"], E + "scheduler is not allowed"),
        ([*DS, X + "{zero_force_ds_cpu_optimizer: true}"], E + "zero_force_ds_cpu_optimizer=True"),
        ([*DS, X + "{checkpoint: {load_universal: true}}"], E + "checkpoint.load_universal is not allowed"),
        (["deepspeed.stage=3"], "the deepspeed section needs backend: deepspeed"),  # backend torch would ignore it
        ([X + "{zero_optimization: {stage: 3}}"], "the deepspeed section needs backend: deepspeed"),
    ],
)
def test_a_pass_through_cannot_reopen_a_trap(recipe, tmp_path, capsys, no_process_group, override, message):
    out = tmp_path / "run"
    assert main(["train", "--config", str(recipe), f"out_dir={out}", *override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("baton train: error:") and err.count("\n") == 1, err
    assert not out.exists()


def test_extra_keys_that_agree_or_only_tune_pass(recipe):
    from baton.train.deepspeed_config import ds_config
    from baton.train.recipe import load_config

    extra = (
        "{train_batch_size: 8, gradient_accumulation_steps: 2, bf16: {enabled: false}, zero_optimization: "
        "{stage: 2, reduce_bucket_size: 1000}}"
    )
    cfg = load_config(recipe, [*DS, "deepspeed.stage=2", f"deepspeed.extra={extra}"])
    conf = ds_config(cfg, 1)
    assert conf["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000} and conf["train_batch_size"] == 8


def test_the_cli_refuses_a_bad_extra_before_starting_anything(recipe, tmp_path):
    """`baton train --config X` as a user runs it: exit 2, one line, nothing written."""
    raw = yaml.safe_load(recipe.read_text())
    raw.update(
        backend="deepspeed", out_dir=str(tmp_path / "run"), deepspeed={"extra": {"zero_optimization": {"stage": 3}}}
    )
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "baton.common.cli", "train", "--config", str(tmp_path / "bad.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "baton train: error: invalid training config: deepspeed.extra.zero_optimization.stage=3" in proc.stderr
    assert "Traceback" not in proc.stderr and "process group" not in proc.stderr.lower()
    assert not (tmp_path / "run").exists()


def test_the_model_section_cannot_shrink_the_vocabulary(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", str(recipe), f"out_dir={out}", "model.vocab_size=8"]) == 2
    assert "model.vocab_size 8 is smaller than the tokenizer's vocabulary" in capsys.readouterr().err
    assert not (out / "checkpoints").exists()


# ---------------------------------------------------------------- resuming on other inputs


@pytest.fixture
def trained(corpus, tmp_path):
    """A 2-step run on its own copy of the corpus: (recipe, out_dir, corpus copy)."""
    data = tmp_path / "data" / "text.txt"
    data.parent.mkdir()
    shutil.copy(corpus, data)
    raw = {
        **TINY,
        "data": {**TINY["data"], "path": str(data), "cache_dir": str(tmp_path / "cache")},
        "max_steps": 2,
        "export": False,
        "out_dir": str(tmp_path / "run"),
    }
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["train", "--config", str(recipe)]) == 0
    return recipe, tmp_path / "run", data


def _refused(recipe, out, capsys, *overrides: str) -> str:
    before = (out / "metrics.jsonl").read_text()
    assert main(["train", "--config", str(recipe), "max_steps=3", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton train: error: resume ") and err.count("\n") == 1, err
    assert "pass --allow-resume-mismatch (or checkpoint.allow_resume_mismatch=true) to resume anyway" in err
    assert (out / "metrics.jsonl").read_text() == before and not (out / "checkpoints" / "step_00000003").exists()
    return err


def test_the_checkpoint_records_what_it_was_trained_on(trained):
    recipe, out, data = trained
    state = json.loads((out / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    inputs = state["inputs"]
    assert inputs["data"]["path"] == str(data) and inputs["data"]["seq_len"] == 32 and inputs["seed"] == 1234
    assert inputs["data"]["fingerprint"]["bytes"] == data.stat().st_size and inputs["data"]["fingerprint"]["files"] == 1
    assert inputs["tokenizer"]["kind"] == "char" and len(inputs["tokenizer"]["sha256"]) == 16


def test_resuming_on_other_data_is_refused(trained, tmp_path, capsys, no_process_group):
    recipe, out, data = trained
    other = tmp_path / "other.txt"
    other.write_text(data.read_text()[::-1])
    # backend=deepspeed would start a process group: the refusal comes before it
    err = _refused(recipe, out, capsys, f"data.path={other}", *DS)
    assert f"data.path was {data} (1 file(s)" in err and f"in the checkpoint, is {other} (1 file(s)" in err
    err = _refused(recipe, out, capsys, "data.seq_len=16")
    assert "data.seq_len was 32 in the checkpoint, is 16 now" in err
    err = _refused(recipe, out, capsys, "data.val_fraction=0.1", "seed=7")
    assert "data.val_fraction was 0.05 in the checkpoint, is 0.1 now" in err and "seed was 1234" in err
    held = tmp_path / "held.txt"
    held.write_text(data.read_text()[:200])
    err = _refused(recipe, out, capsys, f"data.val_path={held}")
    assert f"data.val_path was none (val_fraction of data.path) in the checkpoint, is {held} (1 file(s)" in err
    with data.open("a") as f:  # the same path, with more text in it
        f.write("a few more words")
    assert "the data at data.path (changed since the checkpoint) was" in _refused(recipe, out, capsys)


def test_resuming_with_another_tokenizer_is_refused(trained, tmp_path, capsys):
    recipe, out, _ = trained
    train_char("only a few letters").save(tmp_path / "tok")
    err = _refused(recipe, out, capsys, f"tokenizer.path={tmp_path / 'tok'}")
    assert f"tokenizer.path {tmp_path / 'tok'} holds another tokenizer" in err
    err = _refused(recipe, out, capsys, "tokenizer.kind=bpe")
    assert "tokenizer.kind was 'char' in the checkpoint, is 'bpe' now" in err


def test_moved_data_resumes_and_a_mismatch_can_be_allowed(trained, tmp_path, caplog):
    recipe, out, data = trained
    moved = tmp_path / "scratch" / "text.txt"  # the same content elsewhere (e.g. node-local scratch)
    moved.parent.mkdir()
    shutil.copy(data, moved)
    assert main(["train", "--config", str(recipe), "max_steps=3", f"data.path={moved}"]) == 0
    assert (out / "checkpoints" / "step_00000003").is_dir()
    with caplog.at_level(logging.WARNING, logger="baton.train.provenance"):
        assert (
            main(["train", "--config", str(recipe), "max_steps=4", "data.seq_len=16", "--allow-resume-mismatch"]) == 0
        )
    assert "data.seq_len was 32 in the checkpoint, is 16 now" in caplog.text
    assert (out / "checkpoints" / "step_00000004").is_dir()


def test_a_failure_during_the_work_keeps_its_traceback(recipe, tmp_path, monkeypatch):
    """A ValueError once the checks have passed is a bug or an environment failure, not a bad
    recipe: it propagates (the console script prints its traceback, exit 1) instead of one line."""
    import baton.train.trainer as trainer

    def broken(*args, **kwargs):
        raise ValueError("deep inside the model build")

    monkeypatch.setattr(trainer, "build_model", broken)
    with pytest.raises(ValueError, match="deep inside the model build"):
        main(["train", "--config", str(recipe), f"out_dir={tmp_path / 'run'}", "max_steps=2"])
