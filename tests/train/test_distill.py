"""Distillation data is the model's own output: blocks equal an independent greedy loop, and
`baton distill` writes them as a JSONL corpus a draft recipe can train on."""

from __future__ import annotations

import json

import torch

from baton.common.cli import main
from baton.common.data import DataConfig, build_datasets
from baton.train.distill import teacher_continuations

from .conftest import char_model_checkpoint


def _greedy(model, ids: list[int], width: int) -> list[int]:
    """An independent greedy loop: full recompute, no KV cache, no engine."""
    with torch.no_grad():
        while len(ids) < width:
            ids = ids + [int(model(torch.tensor([ids]))[0, -1].argmax())]
    return ids


def test_teacher_continuations_are_the_models_own_greedy_output(tmp_path):
    corpus, tok, model = char_model_checkpoint(tmp_path, "model")
    ds, _ = build_datasets(DataConfig(path=str(corpus), seq_len=24, cache_dir=str(tmp_path / "cache")), tok)
    blocks = teacher_continuations(tmp_path / "model", ds, count=3, width=25)
    assert blocks.shape == (3, 25)
    starts = {tuple(ds[i]["input_ids"][:6]) for i in range(len(ds))}
    for row in blocks.tolist():
        assert tuple(row[:6]) in starts  # the prompt: the first quarter of a training block
        assert row == _greedy(model, row[:6], 25)


def test_baton_distill_writes_a_jsonl_corpus(tmp_path, capsys):
    corpus, tok, model = char_model_checkpoint(tmp_path, "model")
    out = tmp_path / "runs" / "distill.jsonl"
    assert main(["distill", "--model", str(tmp_path / "model"), "--out", str(out), "--data", str(corpus),
                 "--samples", "4", "--seq-len", "16"]) == 0
    assert "Wrote 4 continuations" in capsys.readouterr().out
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert len(texts) == 4 and not (tmp_path / "runs" / "distill.jsonl.tmp").exists()
    ids = tok.encode(texts[0])
    assert ids == _greedy(model, ids[:4], 17)  # char tokens round-trip: the text is the model's own output

    assert main(["distill", "--model", str(tmp_path), "--out", str(out), "--samples", "4"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["distill", "--model", str(tmp_path / "model"), "--out", str(out), "--samples", "0"]) == 2
    assert "need samples >= 1" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 4  # a refused call leaves the previous file alone
