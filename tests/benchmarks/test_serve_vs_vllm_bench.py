"""The Baton-vs-vLLM serving benchmark in its smoke mode (Baton only, a tiny HF Llama, 8 requests):
it runs end to end through the same driver the full comparison uses, Baton's fp32 greedy outputs
equal HF transformers' on every request, and the JSON/PNG/table come out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_vs_vllm.py"


@pytest.mark.slow
def test_smoke_matches_hf_and_reports(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "serve_vs_vllm.json").read_text())
    assert r["sides"] == ["baton"]
    cell = r["cells"]["tiny fp32"]
    assert cell["fp32_equal_hf"] == "8/8"
    sys.path.insert(0, str(SCRIPT.parent))
    import serve_vs_vllm as bench

    # ignore_eos: every request generates exactly its max_tokens
    assert cell["runs"]["baton"][0]["output_tokens"] == sum(n for _, n in bench.workload(8))
    s = cell["summary"]["baton"]
    assert s["best_tok_per_s"] > 0 and s["startup_s"] > 0
    assert set(s["decode_tok_per_s"]) == {"1", "4"} and all(v > 0 for v in s["decode_tok_per_s"].values())
    assert "| tiny fp32 |" in r["table"] and "| tiny fp32 |" in out.stdout
    assert (tmp_path / "serve_vs_vllm.png").stat().st_size > 10_000


def test_settle_idles_past_the_real_time_throttle_only_under_sched_fifo(monkeypatch, tmp_path):
    """Under SCHED_FIFO a timed window starts after twice the kernel's throttle stall (period -
    runtime) of idle, so that the stall falls outside it; otherwise, or when the kernel does not
    throttle (runtime -1), nothing waits."""
    sys.path.insert(0, str(SCRIPT.parent))
    import serve_vs_vllm as bench

    slept, policy = [], [bench.os.SCHED_OTHER]
    monkeypatch.setattr(bench.time, "sleep", slept.append)
    monkeypatch.setattr(bench.os, "sched_getscheduler", lambda pid: policy[0])
    (tmp_path / "sched_rt_runtime_us").write_text("950000\n")
    (tmp_path / "sched_rt_period_us").write_text("1000000\n")
    bench.settle(tmp_path)
    assert slept == []  # not real-time: the scheduler shares the cores, there is no throttle
    policy[0] = bench.os.SCHED_FIFO
    bench.settle(tmp_path)
    assert slept == [pytest.approx(0.1)]
    (tmp_path / "sched_rt_runtime_us").write_text("-1\n")
    bench.settle(tmp_path)
    assert slept == [pytest.approx(0.1)]
