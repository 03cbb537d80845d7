"""The engine GPU check is prepared for a session that is lent a GPU. Here: it refuses cleanly
without CUDA, its smoke mode (TP=2 on CPU against the CPU reference) runs end to end, and its
comparison tells a near-tie of the reference from a real difference."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCH / "engine_gpu.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda():
    out = run()
    assert out.returncode == 2 and "no CUDA device" in out.stdout, out.stdout + out.stderr[-2000:]
    out = run("--smoke", "--only", "tp1")  # TP=1 on CPU would be the reference itself
    assert out.returncode == 2 and "tp1 on CPU is the reference itself" in out.stdout


@pytest.mark.slow
def test_smoke_checks_tp2_against_the_cpu_reference(tmp_path):
    out = run("--smoke", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "check cpu tp2 vs cpu tp1: " in out.stdout and "0 failure(s)" in out.stdout
    r = json.loads((tmp_path / "engine_gpu.json").read_text())
    [check] = r["checks"]
    assert check["name"] == "cpu tp2 vs cpu tp1" and check["ok"] and check["sequences"] == 10 and r["max_tokens"] == 12
    assert [row["name"] for row in r["throughput"]] == ["cpu tp1 (reference)", "cpu tp2"]
    assert all(row["out_tok_per_s"] > 0 for row in r["throughput"])
    assert (tmp_path / "engine_gpu.png").stat().st_size > 5_000


def test_compare_fails_a_difference_but_not_a_near_tie(monkeypatch):
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # the script sets it on import; restored afterwards
    monkeypatch.syspath_prepend(str(BENCH))
    eg = importlib.import_module("engine_gpu")
    for name in ("CHECKS", "FAILURES"):
        monkeypatch.setattr(eg, name, [])
    ref_tokens = [[5, 6, 7], [1, 2, 3], [4, 4, 4]]
    ref_lp = [
        [{5: -0.1}, {6: -0.2}, {7: -0.3}],
        [{1: -0.1}, {2: -0.69310, 9: -0.69315}, {3: -0.1}],  # token 1: 2 and 9 within TIE
        [{4: -0.1}, {4: -0.1, 8: -3.0}, {4: -0.1}],  # token 1: 8 is far behind
    ]
    eg.compare("same", (ref_tokens, ref_lp), (ref_tokens, None))
    eg.compare("tie", (ref_tokens, ref_lp), ([[5, 6, 7], [1, 9, 0], [4, 4, 4]], None))
    eg.compare("differs", (ref_tokens, ref_lp), ([[5, 6, 7], [1, 2, 3], [4, 8, 4]], None))
    eg.compare("short", (ref_tokens, ref_lp), ([[5, 6], [1, 2, 3], [4, 4, 4]], None))
    assert [(c["name"], c["ok"], len(c["near_ties"])) for c in eg.CHECKS] == [
        ("same", True, 0),
        ("tie", True, 1),
        ("differs", False, 0),
        ("short", False, 0),
    ]
    assert "prompt 2 token 1: 8 where the reference has 4" in eg.FAILURES[0]
