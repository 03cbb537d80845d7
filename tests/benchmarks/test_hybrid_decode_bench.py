"""The hybrid decode benchmark in its smoke mode: both models at both contexts are timed and the
JSON/PNG come out (times are never asserted: they depend on the machine and its load)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_decode_cpu.py"


def test_smoke_reports_both_models(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "hybrid_decode_cpu.json").read_text())
    assert set(r["models"]) == {"attention (llama)", "hybrid (bamba)"}
    for name, rows in r["models"].items():
        assert [row["context"] for row in rows] == [16, 64]
        assert all(row["ms_per_token"] > 0 for row in rows)
        # Only the hybrid carries recurrent state, and its size does not grow with the context.
        states = [row["state_mb"] for row in rows]
        assert (states[0] > 0 and states[0] == states[1]) if "bamba" in name else states == [0, 0]
    assert (tmp_path / "hybrid_decode_cpu.png").stat().st_size > 10_000
