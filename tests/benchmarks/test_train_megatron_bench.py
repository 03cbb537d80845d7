"""benchmarks/train_megatron.py's smoke mode (tiny model, tp=2, one round) keeps the megatron vs
torch-native benchmark runnable: both backends trained the same data to the same losses, a rate
and per-rank memory were measured, and the table, JSON and PNG were written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_megatron.py"
pytest.importorskip("megatron.core")


@pytest.mark.slow
def test_smoke_runs_both_backends_and_writes_results(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "train_megatron.json").read_text())
    cell = result["best"]["tp2"]
    assert set(cell) == {"torch3d", "megatron"}
    torch3d, megatron = cell["torch3d"], cell["megatron"]
    # the same recipe through the same trainer: equal losses at every step (fp32 rounding)
    assert len(torch3d["losses"]) == result["steps"]
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(torch3d["losses"], megatron["losses"]))
    for row in (torch3d, megatron):
        assert row["tokens_per_s"] > 0 and len(row["state_bytes_per_rank"]) == 2
        assert all(b > 0 for b in row["state_bytes_per_rank"] + row["rss_bytes_per_rank"])
    assert "| tp2 | megatron |" in out.stdout
    assert (tmp_path / "train_megatron.png").stat().st_size > 10_000
