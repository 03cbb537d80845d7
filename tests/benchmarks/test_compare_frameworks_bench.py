"""benchmarks/compare_frameworks.py in its smoke mode (a tiny HF Llama, Baton and the two HF
transformers sides, 8 requests, fp32): every side runs through the same driver the full comparison
uses, HF's greedy outputs (one request at a time, and left-padded static batches) equal Baton's
request by request, and the JSON/PNG/table come out with every column."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_frameworks.py"


@pytest.mark.slow
def test_smoke_sides_agree_and_report(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "compare_frameworks.json").read_text())
    assert r["sides"] == ["baton", "hf", "hf-b1"]
    cell = r["cells"]["tiny fp32"]
    assert cell["agreement"] == {"hf": "8/8", "hf-b1": "8/8"}
    sys.path.insert(0, str(SCRIPT.parent))
    import serve_vs_vllm as bench

    # ignore_eos on every side: each request generates exactly its max_tokens
    for side in r["sides"]:
        assert cell["runs"][side][0]["output_tokens"] == sum(n for _, n in bench.workload(8))
        s = cell["summary"][side]
        assert set(s) == {"best_tok_per_s", "ttft_ms", "decode_ms_per_token", "peak_rss_mib", "startup_s"}
        assert all(v > 0 for v in s.values())
    import compare_frameworks

    header = r["table"].splitlines()[0]
    assert all(f" {c} |" in header for c in compare_frameworks.COLUMNS)
    for side in r["sides"]:
        assert f"| tiny fp32 | {side} |" in r["table"] and f"| tiny fp32 | {side} |" in out.stdout
    assert "llama.cpp not measured" in r["table"]
    assert (tmp_path / "compare_frameworks.png").stat().st_size > 10_000
