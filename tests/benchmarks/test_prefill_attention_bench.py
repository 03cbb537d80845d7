"""The CPU prefill-attention benchmark in its quick mode: both paths agree with the torch reference
(the script asserts it before timing) for every shape, dtype and prefix case, and the JSON/PNG
come out. Times are never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..system import needs

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_attention_cpu.py"


@needs("c++")  # the benchmark's kernel side: a build that fails with a compiler there fails the test
def test_quick_run_checks_both_paths_and_writes_results(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "prefill_attention_cpu.json").read_text())["rows"]
    assert {(r["shape"], r["dtype"], r["prefixes"]) for r in rows} == {
        (s, d, p)
        for s in ("25M (8/2)", "110M (16/4)")
        for d in ("float32", "bfloat16")
        for p in ("none", "0-512 cached")
    }
    assert all(r["sdpa_ms"] > 0 and r["kernel_ms"] > 0 and r["chunks"] > 12 for r in rows)
    assert (tmp_path / "prefill_attention_cpu.png").stat().st_size > 10_000
