"""benchmarks/train_compile.py's smoke mode (tiny model, aot_eager, one round) keeps the compile
benchmark runnable: eager and compiled both trained (finite losses, equal to rounding), a compile
time was measured, and the table, JSON and PNG were written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_compile.py"


def test_smoke_runs_eager_and_compiled_and_writes_results(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "train_compile.json").read_text())
    runs = result["rounds_raw"]
    assert sorted(r["compiled"] for r in runs) == [False, True]
    for r in runs:
        assert len(r["losses"]) == result["steps"] and all(math.isfinite(x) for x in r["losses"])
        assert r["tokens_per_s"] > 0
    eager, compiled = sorted(runs, key=lambda r: r["compiled"])
    # the same model, data and step: compiled layers compute the eager numbers (to float32 rounding)
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(eager["losses"], compiled["losses"]))
    assert compiled["compile_s"] > 0 and "| tiny | fp32 |" in out.stdout
    assert (tmp_path / "train_compile.png").stat().st_size > 10_000
