"""benchmarks/coe.py in its smoke mode: both routers are trained and scored, both setups serve the
whole mixed workload (the CoE through more than one expert, the baseline through the largest
only), and the JSON/PNG come out (times are never asserted: they depend on the machine's load)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "coe.py"


@pytest.mark.slow
def test_smoke_reports_routers_and_both_setups(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "coe.json").read_text())
    assert set(r["router"]) == {"classifier", "knn"}
    assert all(0.4 < v["held_out_accuracy"] <= 1 for v in r["router"].values())  # 3 kinds: chance is 1/3
    coe, one = r["throughput"]["coe (3 experts, routed)"], r["throughput"]["largest expert only"]
    assert sum(coe["served"].values()) == sum(one["served"].values()) == r["requests"]
    assert len(coe["served"]) > 1 and one["served"] == {"generalist": r["requests"]}
    assert r["latency_ms"]["router_in_server"] > 0
    assert (tmp_path / "coe.png").stat().st_size > 10_000
