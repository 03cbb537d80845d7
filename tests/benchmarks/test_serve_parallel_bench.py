"""The distributed-serving benchmark in its smoke mode (a tiny model, one run per layout): it runs
end to end, and the per-rank numbers it reports agree with the model's shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_parallel.py"


@pytest.mark.slow
def test_smoke_reports_every_layout(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--profile", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "serve_parallel.json").read_text())
    rows = r["layouts"]
    assert list(rows) == ["T=1", "T=2", "P=2", "T=1/1t"]
    cores = os.cpu_count() or 1
    assert [rows[k]["threads_per_rank"] for k in rows] == [cores, max(1, cores // 2), max(1, cores // 2), 1]
    for row in rows.values():
        assert 0 < row["out_tok_per_s"] <= row["best_out_tok_per_s"] and row["decode"]["round_ms"] > 0
        for q in ("ttft_s", "tpot_s"):
            assert 0 < row[q]["p50"] <= row[q]["p90"]

    # per-rank memory against the single process's: the smoke model has 4 KV heads and 2 layers, so
    # T=2 splits the heads and P=2 the layers, each rank holding exactly half the KV pool; weights
    # are split too, except the replicated norms (T=2) and the tied embedding each stage holds (P=2)
    one = rows["T=1"]
    assert len(one["weight_bytes"]) == 1 and rows["T=1/1t"]["weight_bytes"] == one["weight_bytes"]
    for name in ("T=2", "P=2"):
        row = rows[name]
        assert row["kv_bytes"] == [one["kv_bytes"][0] // 2] * 2, name
        assert all(w < one["weight_bytes"][0] for w in row["weight_bytes"]), name
        assert sum(row["weight_bytes"]) >= one["weight_bytes"][0], name
        assert row["control_ms_per_step"] > 0 and row["steps"] > 0, name
    assert "control_ms_per_step" not in one

    plan = r["step_plan_64_decodes"]
    assert plan["batch"] == 64 and plan["step_plan"]["bytes"] > 64 * 4
    assert plan["wire_steady"]["bytes"] < plan["wire_first"]["bytes"]  # known block tables are not resent
    assert set(r["profile"]) == set(rows)
    for prof in r["profile"].values():
        assert prof["ms_per_step"]["matmul"] > 0
    assert r["profile"]["T=2"]["ms_per_step"]["collectives"] > 0
    assert (tmp_path / "serve_parallel.png").stat().st_size > 10_000
