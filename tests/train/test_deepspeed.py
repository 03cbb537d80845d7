"""DeepSpeed specifics: non-finite steps never applied at any stage, Baton's ZeRO checkpoint
conversion against DeepSpeed's own zero_to_fp32, and the JIT-build lock guard."""

import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from baton.train.backends import deepspeed as ds_backend
from baton.train.backends.zero_checkpoint import TAG
from baton.train.config import config_from_dict

from .conftest import CKPT_STEP, TINY, final_state, run

pytestmark = pytest.mark.slow


def test_non_finite_steps_are_skipped_at_every_zero_stage(runs, tmp_path):
    out = tmp_path / "report.json"
    script = str(Path(__file__).with_name("nan_run.py"))
    run(1, [str(runs.recipe), str(tmp_path), str(out)], tmp_path / "nan.log", script=script)
    report = json.loads(out.read_text())
    for stage, r in report.items():
        assert r["skipped"] == 2 and math.isfinite(r["final_loss"]), stage
        assert r["seen"][2] == r["seen"][3] == [False, True], stage  # skipped, weights untouched
        assert all(applied and not same for applied, same in r["seen"][:2] + r["seen"][4:]), stage


@pytest.mark.parametrize("mode", ["z1-2", "z2-2", "z3-2", "z3-offload-cpuadam-2"])
def test_zero_conversion_matches_deepspeeds_zero_to_fp32(runs, mode):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = runs.get(mode) / "checkpoints" / f"step_{CKPT_STEP:08d}"
    ours = final_state(runs.get(mode), CKPT_STEP)
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=TAG)
    assert ours.weights.keys() == theirs.keys()
    assert all(torch.equal(ours.weights[k], theirs[k]) for k in theirs)
    assert ours.step == CKPT_STEP and ours.exp_avg.keys() == ours.exp_avg_sq.keys() == theirs.keys()
    assert all((ours.exp_avg_sq[k] >= 0).all() and ours.exp_avg_sq[k].abs().sum() > 0 for k in theirs)


def test_a_stale_build_lock_is_removed_and_builds_are_serialised(tmp_path, monkeypatch):
    """torch's extension builder waits forever on a `lock` file a killed build left behind."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").touch()
    active, overlaps = [], []

    class FakeBuilder:
        name = "cpu_adam"

        def load(self, verbose=False):
            assert not (tmp_path / "cpu_adam" / "lock").exists()
            overlaps.append(len(active))
            active.append(1)
            time.sleep(0.2)
            active.pop()

    monkeypatch.setattr(ds_backend, "_builders", lambda cfg: [FakeBuilder()])
    cfg = config_from_dict(TINY, ["backend=deepspeed", "deepspeed.stage=2", "deepspeed.offload_optimizer=cpu"])
    threads = [threading.Thread(target=ds_backend.prepare_ops, args=(cfg,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == [0, 0, 0]  # one build at a time
