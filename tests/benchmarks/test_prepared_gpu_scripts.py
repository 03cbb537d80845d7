"""The MLA decode and gated-delta GPU scripts are prepared for a session that is lent a GPU; their
smoke mode (tiny shapes, Triton interpreter) keeps them runnable here, so they have not rotted when
a GPU comes: every check they make passes against its reference."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script", ["mla_gpu.py", "gated_delta_gpu.py"])
def test_smoke_checks_pass_against_the_references(script, tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    checks = re.findall(r"^  check (.+?)\s+rel err\s+(\S+)\s+(ok|FAIL)$", out.stdout, re.M)
    assert len(checks) >= 3 and all(status == "ok" for *_, status in checks), checks
    assert "0 failure(s)" in out.stdout
