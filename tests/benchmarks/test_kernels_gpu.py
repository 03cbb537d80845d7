"""The GPU kernel script is prepared for a session that is lent a GPU; its smoke mode (tiny shapes,
Triton interpreter) keeps it runnable here, so it has not rotted when a GPU finally comes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_gpu.py"
KERNELS = (
    "flash fwd",
    "flash bwd",
    "paged prefix",
    "decode",
    "reshape_and_cache",
    "rms_norm",
    "rotary",
    "swiglu",
    "int8",
    "int4",
    "fp8",
    "w8a8",
    "quantize_per_token",
)


def test_smoke_checks_every_kernel_against_its_reference(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    checks = re.findall(r"^  check (.+?)\s+rel err\s+(\S+)\s+(ok|FAIL)$", out.stdout, re.M)
    assert checks and all(status == "ok" for *_, status in checks), checks
    names = " ".join(name for name, *_ in checks)
    assert [k for k in KERNELS if k not in names] == [], names
    assert "0 failure(s)" in out.stdout

    # the results a GPU run records: every printed check and a timing row per section
    result = json.loads((tmp_path / "kernels_gpu.json").read_text())
    assert [(c["name"], c["ok"]) for c in result["checks"]] == [(n.strip(), True) for n, *_ in checks]
    assert {r["section"] for r in result["timings"]} == {"attention", "paged", "elementwise", "quant"}
    assert all(r["ms"] > 0 and r["pct_of_ceiling"] >= 0 for r in result["timings"])
    assert (tmp_path / "kernels_gpu.png").stat().st_size > 10_000
