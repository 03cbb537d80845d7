"""The init_from memory benchmark in its smoke mode (FSDP2 and ZeRO-3 at world size 2, a 17M-
parameter model): with meta-device init no rank's peak reaches one whole fp32 copy of the model
while its shards are filled; the control, the whole model built first, does reach it (so the
measurement can tell the two apart)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_init_memory.py"


@pytest.mark.slow
def test_no_rank_holds_the_whole_model(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "train_init_memory.json").read_text())["rows"]
    assert {(r["mode"], r["meta"]) for r in rows} == {(m, x) for m in ("FSDP2 (dp=2)", "ZeRO-3") for x in (False, True)}
    assert (tmp_path / "train_init_memory.png").is_file()
    for r in rows:
        full, peaks = r["full_model_bytes"], r["loaded_peak_bytes"]
        assert len(peaks) == 2 and all(x["held_param_bytes"] < 0.55 * full for x in r["ranks"]), r
        if r["meta"]:  # this rank's half plus tensors in flight (ZeRO-3: 0.80-0.92x seen), never a whole copy
            assert max(peaks) < full, f"{r['mode']}: a rank's peak {max(peaks) / full:.2f}x the whole model"
        else:
            assert min(peaks) >= full, f"{r['mode']}: the control's peak {min(peaks) / full:.2f}x the whole model"
