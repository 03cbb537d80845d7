"""Medusa-1 training on a frozen base: the heads learn, the base does not move, the server loads them."""

from __future__ import annotations

import pytest
import torch

from baton.common.checkpoint import load_checkpoint
from baton.common.medusa import load_medusa
from baton.common.data import DataConfig, build_datasets, torch_loader
from baton.train.medusa import MedusaTrainConfig, medusa_loss, train_medusa

from .conftest import char_model_checkpoint


def test_heads_learn_and_base_stays_frozen(tmp_path):
    corpus, tok, _ = char_model_checkpoint(tmp_path)
    data = DataConfig(path=str(corpus), seq_len=48, val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    cfg = MedusaTrainConfig(base=str(tmp_path / "base"), data=data, num_heads=2, steps=60, batch_size=8, lr=3e-3)

    ds, _ = build_datasets(data, tok)
    batch = next(torch_loader(ds, 16, seed=0))
    before_base = load_checkpoint(tmp_path / "base").model
    from baton.common.medusa import MedusaConfig, MedusaHeads

    init = MedusaHeads(MedusaConfig(64, tok.vocab_size, 2))
    init.init_from_lm_head(before_base.lm_head)
    with torch.no_grad():
        hidden = before_base.hidden(batch[:, :-1])
        _, loss_before = medusa_loss(init, hidden, batch, 0.8)
    train_medusa(cfg)
    heads = load_medusa(tmp_path / "base")
    with torch.no_grad():
        _, loss_after = medusa_loss(heads, hidden, batch, 0.8)
    assert all(a < 0.7 * b for a, b in zip(loss_after, loss_before)), (loss_before, loss_after)
    after_base = load_checkpoint(tmp_path / "base").model  # sha256s in baton.json still verify
    for (k, v), (_, w) in zip(before_base.state_dict().items(), after_base.state_dict().items()):
        assert torch.equal(v, w), k


def test_bad_medusa_configs(tmp_path):
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        MedusaTrainConfig(base=str(tmp_path))
    corpus, _, _ = char_model_checkpoint(tmp_path)
    data = DataConfig(path=str(corpus), seq_len=48, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="make no full batch of 4096"):  # not an endless wait for one
        train_medusa(MedusaTrainConfig(base=str(tmp_path / "base"), data=data, batch_size=4096))


def test_baton_train_runs_a_medusa_recipe(tmp_path):
    import subprocess
    import sys

    import yaml

    from baton.serve.distill import DistillConfig, write_distillation_corpus

    corpus, _, _ = char_model_checkpoint(tmp_path)
    # self-distillation: the heads train on the base's own continuations, written by `baton distill`
    distilled = write_distillation_corpus(
        tmp_path / "base",
        tmp_path / "distill.jsonl",
        DistillConfig(DataConfig(path=str(corpus), seq_len=32, cache_dir=str(tmp_path / "cache")), samples=8),
    )
    recipe = tmp_path / "medusa.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "medusa": {"base": str(tmp_path / "base"), "num_heads": 2, "steps": 5, "batch_size": 4},
                "data": {
                    "path": str(distilled),
                    "seq_len": 32,
                    "val_fraction": 0,
                    "cache_dir": str(tmp_path / "cache"),
                },
            }
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "baton.common.cli", "train", "--config", str(recipe), "medusa.lr=2e-3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Medusa heads written into" in out.stdout
    assert load_medusa(tmp_path / "base").config.num_heads == 2

    recipe.write_text(yaml.safe_dump({"medusa": {"base": str(tmp_path / "base"), "num_head": 2}}))
    bad = subprocess.run(
        [sys.executable, "-m", "baton.common.cli", "train", "--config", str(recipe)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "num_head" in bad.stderr
