"""The `baton` console script, run as a user would (a real subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import transformers

BATON = Path(sys.executable).parent / "baton"


def baton(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(BATON), *args], capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_help_lists_subcommands():
    out = baton("--help").stdout
    for cmd in ("demo", "train", "convert", "info", "generate"):
        assert cmd in out


def test_convert_both_ways_and_info(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    baton("convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "b"), "--dtype", "float16")
    info = json.loads(baton("info", str(tmp_path / "b"), "--verify").stdout)
    assert info["config"]["model_type"] == "mistral" and info["config"]["sliding_window"] == 8
    assert info["config"]["torch_dtype"] == "float16" and info["metadata"]["producer"].startswith("baton convert")
    baton("convert", "--to-hf", str(tmp_path / "b"), str(tmp_path / "hf2"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    assert back.dtype == torch.float16
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert (back.float()(ids).logits - hf(ids).logits).abs().max() < 1e-2  # fp16 rounding only


def test_errors_are_one_clear_line(tmp_path):
    proc = baton("convert", "--from-hf", str(tmp_path / "missing"), str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and "no config.json" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "bad.yaml").write_text("max_steps: 10\nlearning_rate: 3\n")
    proc = baton("train", "--config", str(tmp_path / "bad.yaml"), check=False)
    assert proc.returncode == 2 and "learning_rate" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
    # a bad speculative setting is refused before the server loads anything or binds a port
    proc = baton(
        "serve",
        "--model",
        str(tmp_path),
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--speculative",
        "ngram",
        "--speculative-disable-above-batch",
        "0",
        check=False,
    )
    assert proc.returncode == 2 and "disable_above_batch must be >= 1" in proc.stderr and "listening" not in proc.stderr


def test_bench_lists_runs_and_refuses_unknown_benchmarks():
    listing = baton("bench").stdout
    scripts = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))
    assert [line.split()[0] for line in listing.splitlines()] == scripts
    assert "paged_decode_cpu" in scripts and "serve_engine" in scripts
    usage = baton("bench", "serve_engine", "--help").stdout  # the script's own argparse: arguments pass through
    assert "serve_engine.py" in usage and "--quick" in usage
    proc = baton("bench", "no_such_bench", check=False)
    assert (
        proc.returncode == 2 and "unknown benchmark 'no_such_bench'" in proc.stderr and "Traceback" not in proc.stderr
    )


def test_debug_prints_the_traceback_of_a_user_error_too(tmp_path):
    proc = baton("--debug", "train", "--config", str(tmp_path / "missing.yaml"), check=False)
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert f"baton train: error: training config {tmp_path / 'missing.yaml'} does not exist" in proc.stderr
