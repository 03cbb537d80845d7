"""Distillation data is the model's own output: blocks equal an independent greedy loop, and
`baton distill` writes them, token ids beside the text, as a JSONL corpus that trains on those ids."""

from __future__ import annotations

import json

import torch

from baton.common.cli import main
from baton.common.data import DataConfig, build_datasets
from baton.serve.distill import teacher_continuations

from ..train.conftest import char_model_checkpoint


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


def test_baton_distill_writes_the_models_token_ids_and_training_reads_them(tmp_path, capsys):
    corpus, tok, model = char_model_checkpoint(tmp_path, "model")
    out = tmp_path / "runs" / "distill.jsonl"
    assert (
        main(
            [
                "distill",
                "--model",
                str(tmp_path / "model"),
                "--out",
                str(out),
                "--data",
                str(corpus),
                "--samples",
                "4",
                "--seq-len",
                "16",
            ]
        )
        == 0
    )
    assert "Wrote 4 continuations" in capsys.readouterr().out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 4 and not (tmp_path / "runs" / "distill.jsonl.tmp").exists()
    for line in lines:
        ids = line["token_ids"]
        assert ids == _greedy(model, ids[:4], 17)  # the model's own output, token for token
        assert line["text"] == tok.decode(ids)

    data = DataConfig(path=str(out), seq_len=8, val_fraction=0, cache_dir=str(tmp_path / "cache"))
    train, _ = build_datasets(data, tok)
    stream = [i for line in lines for i in line["token_ids"] + [tok.eos_token_id]]
    assert train[:]["input_ids"] == [stream[k * 9 : (k + 1) * 9] for k in range(len(stream) // 9)]

    assert main(["distill", "--model", str(tmp_path), "--out", str(out), "--samples", "4"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["distill", "--model", str(tmp_path / "model"), "--out", str(out), "--samples", "0"]) == 2
    assert "need samples >= 1" in capsys.readouterr().err
    assert out.read_text().splitlines() == [json.dumps(line) for line in lines]  # refused calls leave the file alone
