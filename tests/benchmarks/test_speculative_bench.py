"""The speculative decoding benchmark in its smoke mode: every mode runs (tiny random models) and
the results carry speed, acceptance and per-depth acceptance for each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "speculative.py"


@pytest.mark.slow
def test_every_mode_runs_and_reports(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "speculative.json").read_text())["rows"]
    modes = {r["mode"] for r in rows}
    assert {"plain", "lookahead W=4 N=4 G=4", "draft tree k=3 w=2", "medusa tree choices", "eagle tree k=4 w=2"} <= modes
    assert any(m.startswith("layerskip") for m in modes) and "calm t=0.6" in modes
    assert all("ppl" in r and 0 <= r["agreement"] <= 1 for r in rows if r["mode"].startswith("calm"))
    assert len(rows) == len(modes) * 4 and (tmp_path / "speculative.png").is_file()
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 <= r["acceptance_rate"] <= 1, r
        assert all(0 <= a <= 1 for a in r["acceptance_by_depth"]), r
        assert r["mode"].startswith(("plain", "calm")) == (r["acceptance_by_depth"] == []), r
