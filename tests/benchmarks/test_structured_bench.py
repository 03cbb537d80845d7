"""The structured-outputs benchmark in its smoke mode: it runs end to end (tiny random model) and
its results hold the per-token overhead rows it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "structured.py"


@pytest.mark.slow
def test_smoke_runs_and_reports(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "structured.json").read_text())
    rows = results["end_to_end"]["320"]
    assert [(r["batch"], r["speculative"]) for r in rows] == [(1, False), (4, False), (4, True)]
    for r in rows:
        assert r["tokens"] > 0 and r["constrained_ms_per_token"] > 0 and r["unconstrained_ms_per_token"] > 0, r
    assert [r["batch"] for r in results["sampler"]["320"]] == [1, 4]
    assert results["compile"][0]["first_ms"] > 0 and (tmp_path / "structured.png").is_file()
