"""The MoE/EP benchmark in its smoke mode (a tiny 8-expert model, 2 steps per layout at world
size 2): every layout runs and reports, and the numbers show what EP changes - the ranks hold the
model once between them either way, but under EP the expert weights stop moving (fewer bytes
all-gathered and reduce-scattered) and tokens travel by all-to-all instead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_moe.py"


@pytest.mark.slow
def test_ep_moves_tokens_instead_of_expert_weights(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "train_moe.json").read_text())
    rows = {r["layout"]: r for r in result["rows"]}
    assert set(rows) == {"FSDP2 dp=2", "FSDP2 dp=2, EP=2", "DDP dp=2"}
    assert (tmp_path / "train_moe.png").is_file()
    fsdp, ep, ddp = rows["FSDP2 dp=2"], rows["FSDP2 dp=2, EP=2"], rows["DDP dp=2"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and len(r["param_mb"]) == 2
    assert sum(fsdp["param_mb"]) == pytest.approx(sum(ep["param_mb"])) == pytest.approx(ddp["param_mb"][0])
    moved = lambda r: r["collective_mb_per_step"].get("all_gather_single", 0)  # noqa: E731
    assert 0 < moved(ep) < moved(fsdp)
    assert ep["collective_mb_per_step"]["all_to_all_single"] > 0
    assert "all_to_all_single" not in fsdp["collective_mb_per_step"]
