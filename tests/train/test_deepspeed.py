"""DeepSpeed specifics: non-finite steps never applied at any stage, Baton's ZeRO checkpoint
conversion against DeepSpeed's own zero_to_fp32, the JIT-build lock guard, and the op build cache
shared by checkouts (deepspeed_ops.py)."""

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from baton.common.corpus import cache_root
from baton.train.backends import deepspeed as ds_backend
from baton.train.backends.deepspeed_ops import build_root
from baton.train.backends.zero_checkpoint import TAG
from baton.train.recipe import config_from_dict

from .conftest import CKPT_STEP, TINY, environment, final_state, run

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
    folder = build_root(tmp_path)
    (folder / "cpu_adam").mkdir(parents=True)
    (folder / "cpu_adam" / "lock").touch()
    active, overlaps = [], []

    class FakeBuilder:
        name = "cpu_adam"

        def load(self, verbose=False):
            assert not (folder / "cpu_adam" / "lock").exists()
            overlaps.append(len(active))
            active.append(1)
            time.sleep(0.2)
            active.pop()

    monkeypatch.setattr(ds_backend, "_builders", lambda cfg: [FakeBuilder()])
    from deepspeed.ops.op_builder.builder import OpBuilder

    monkeypatch.setattr(OpBuilder, "jit_load", OpBuilder.jit_load)  # prepare_ops routes it to tmp_path: undone after
    cfg = config_from_dict(TINY, ["backend=deepspeed", "deepspeed.stage=2", "deepspeed.offload_optimizer=cpu"])
    threads = [threading.Thread(target=ds_backend.prepare_ops, args=(cfg,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == [0, 0, 0]  # one build at a time


CACHED_LOAD = """
import sys, torch
from pathlib import Path
from deepspeed.ops.op_builder.builder import OpBuilder
from baton.train.backends import deepspeed_ops

def no_build(self, verbose=True):
    print(f"JIT build of {self.name}", flush=True)
    raise RuntimeError("no build here")

OpBuilder.jit_load = no_build  # any build fails: what loads came from the cache
deepspeed_ops.use_build_cache(Path(sys.argv[1]))
from deepspeed.ops.adam import DeepSpeedCPUAdam

w = torch.randn(64, generator=torch.Generator().manual_seed(0))
ours, ref = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
kw = dict(lr=1e-2, weight_decay=0.1)
opts = [DeepSpeedCPUAdam([ours], adamw_mode=True, **kw), torch.optim.AdamW([ref], **kw)]
for p, opt in zip((ours, ref), opts):
    p.grad = torch.linspace(-1, 1, 64)
    opt.step()
print("max diff", (ours - ref).abs().max().item())
OpBuilder._loaded_ops.clear()
deepspeed_ops.sources_digest = lambda b: "other sources"
try:
    DeepSpeedCPUAdam([ours])
except RuntimeError:
    pass
"""


def test_a_built_op_is_loaded_from_the_cache_and_only_for_the_same_sources(runs, tmp_path):
    """Another process (another checkout alike: only the sources' digest counts) imports the library
    built before instead of rebuilding it; sources that differ from the build's are rebuilt."""
    runs.get("z3-offload-cpuadam-2")  # a run that built (or loaded) cpu_adam
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache_root() / "torch_extensions")
    proc = subprocess.run(
        [sys.executable, "-c", CACHED_LOAD, str(root)], capture_output=True, text=True, timeout=120, env=environment(1)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("max diff", "JIT build"))]
    assert len(lines) == 2 and float(lines[0].removeprefix("max diff ")) <= 1e-6, lines  # no build before
    assert lines[1] == "JIT build of cpu_adam", lines
