"""launchers/torchrun.sh and launchers/deepspeed.sh start real 2-rank runs (gloo on CPU)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from baton.train.distributed import free_port

from .conftest import environment

pytestmark = pytest.mark.slow
LAUNCHERS = Path(__file__).resolve().parents[2] / "launchers"


@pytest.mark.parametrize("launcher, extra", [
    ("torchrun.sh", []),
    ("deepspeed.sh", ["backend=deepspeed", "deepspeed.stage=1"]),
])
def test_launcher_starts_two_ranks(recipe, tmp_path, launcher, extra):
    out = tmp_path / "run"
    env = {k: v for k, v in environment(2).items() if k != "OMP_NUM_THREADS"}  # the launcher sets it
    port = ["--master-port", str(free_port())] if launcher == "deepspeed.sh" else []
    cmd = [str(LAUNCHERS / launcher), "--nproc", "2", *port, "--", "--config", str(recipe), f"out_dir={out}",
           "max_steps=3", "checkpoint.interval=0", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((out / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["layout"]["world_size"] == 2
    assert state["layout"]["backend"] == ("deepspeed" if extra else "torch")
    assert (out / "handoff" / "model.safetensors").is_file()
    assert proc.stdout.count("Trained 3 steps") == 1  # one report, from rank 0


def test_launchers_reject_unknown_options():
    for launcher in ("torchrun.sh", "deepspeed.sh"):
        proc = subprocess.run([str(LAUNCHERS / launcher), "--nodes", "2"], capture_output=True, text=True,
                              env={**os.environ})
        assert proc.returncode == 2 and "unknown option --nodes" in proc.stderr
