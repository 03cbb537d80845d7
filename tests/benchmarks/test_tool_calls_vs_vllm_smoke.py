"""benchmarks/tool_calls_vs_vllm.py in its smoke mode, Baton alone (CI has no vLLM): a real `baton
serve` with the hermes parser answers tool_choice "required" and "none" over the openai client, the
"none" runs make exactly the required runs' token counts (ignore_eos), every required answer is
accounted for (valid, or why not), the grammar cache counts one miss and one hit per new tool set,
the streamed hermes call reassembles to its JSON, and JSON/PNG/tables come out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tool_calls_vs_vllm.py"


@pytest.mark.slow
def test_smoke_runs_baton_and_reports(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--no-vllm", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "tool_calls_vs_vllm.json").read_text())
    assert r["sides"] == ["baton"] and r["model"] == "tiny"
    b = r["engines"]["baton"]
    assert [(x["tools"], x["concurrency"]) for x in b["tool_calls"]] == [(1, 1), (10, 1), (1, 2), (10, 2)]
    for x in b["tool_calls"]:
        assert x["answers"] == 2 * x["requests"]  # the warm-up and one timed run
        assert x["valid"] + sum(x["invalid"].values()) == x["answers"], x
        assert set(x["invalid"]) <= {"truncated"}, x  # enforced: a complete answer always validates
        assert x["required_ms_per_token"] > 0 and x["free_ms_per_token"] > 0
    assert [x["concurrency"] for x in b["plain"]] == [1, 2]
    for t in b["ttft"]:  # one new tool set each: "required" compiles it once, then hits
        assert t["server"]["misses"] == 1 and t["server"]["hits"] == 1, t
        assert t["ttft_miss_ms"] > 0 and t["ttft_hit_ms"] > 0
    p = r["parsers"]["baton"]
    assert p["streamed_arguments_equal"] and p["ids_sent"] == 1 and p["tokens"] > 100
    assert "| 10 | 2 |" in r["table"] and "Time to first token" in out.stdout
    assert (tmp_path / "tool_calls_vs_vllm.png").stat().st_size > 10_000
