"""benchmarks/serve_threads.py in its smoke mode: each OpenMP setting reaches the measured process
(torch's thread count follows OMP_NUM_THREADS, Baton's own choice is made before torch loads), no
setting changes the greedy tokens, and the
JSON/PNG/table come out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_threads.py"


def test_smoke_runs_each_setting_in_its_own_process(tmp_path):
    settings = ["default", "1 thread", "auto"]  # each a process: keep CI short
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--competitors", "0", "--out", str(tmp_path), "--settings"]
    out = subprocess.run(cmd + settings, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "serve_threads_smoke.json").read_text())
    assert r["threads"]["1 thread"] == 1 and r["threads"]["auto"] == r["threads"]["default"] == r["cores"]
    assert r["settings_changing_greedy_tokens"] == []
    assert "spin" in r["openmp"]["default"]["0"] and "OpenMP threads" in r["openmp"]["auto"]["0"]
    assert all(r["results"][s]["0"][str(b)] > 0 for s in settings for b in r["batches"])
    assert (tmp_path / "serve_threads_smoke.png").stat().st_size > 0 and "| auto |" in out.stdout
