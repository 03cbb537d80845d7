"""benchmarks/serve_http.py in its smoke mode: the engine, gRPC and HTTP paths all run, the HTTP
texts equal the offline engine's, the HTTP usage equals the tokens made, and JSON/PNG/table come out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_http.py"


@pytest.mark.slow
def test_smoke_runs_every_path_and_reports(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "serve_http.json").read_text())
    assert r["concurrency"] == [1, 4]
    for c in ("1", "4"):
        run = r["runs"][c]
        assert run["http_texts_differing_from_offline"] == 0 and run["grpc_outputs_differing_from_offline"] == 0
        assert run["http_usage_equals_tokens_made"]
        for path in ("engine", "grpc", "http"):
            assert run[path]["tokens"] == 8 * 8 and run[path]["tok_per_s"] > 0  # ignore_eos: 8 requests x 8 tokens
    assert "| 4 | http |" in r["table"] and "| 4 | http |" in out.stdout
    assert (tmp_path / "serve_http.png").stat().st_size > 10_000
