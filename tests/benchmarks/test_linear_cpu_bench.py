"""The bf16 CPU linear benchmark in its smoke mode: every side of both sections is timed and the
JSON/PNG come out (times are never asserted: they depend on the machine and its load)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baton.kernels.cpu_extension import cpu_kernels
from baton.kernels.linear_cpu import prepacked_available

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "linear_cpu.py"


@pytest.mark.skipif(not prepacked_available(), reason="no oneDNN bf16 on this CPU")
def test_smoke_reports_every_side(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--clock", "thread", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "linear_cpu.json").read_text())
    assert [c["rows"] for c in r["linears"]] == [1, 4]
    sides = {"fp32 F.linear", "fp32 packed", "bf16 F.linear", "bf16 packed"}
    ck = cpu_kernels()  # Baton's GEMM is a side wherever this build has it
    sides |= {
        f"{n} baton" for n, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)) if ck and ck.gemm_available(dt)
    }
    assert all(set(c["ms"]) == sides for c in r["linears"])
    assert [d["batch"] for d in r["decode"]] == [1, 2]
    assert all(v > 0 for d in r["decode"] for v in d["ms"].values()) and r["threads"] == 1
    assert (tmp_path / "linear_cpu.png").stat().st_size > 10_000
