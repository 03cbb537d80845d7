"""ZeRO-3 with optimizer state and parameters swapped to NVMe (a local folder): the same numbers
as CPU offload, a SIGKILLed run resumes exactly, and a checkpoint resumes at another world size.
DeepSpeed's own files lack the swapped state and its load_checkpoint skips the optimizer state
under NVMe offload; Baton writes and restores that state itself (backends/deepspeed.py)."""

import pytest
import torch

from .conftest import CKPT_STEP, MODES, NVME, STEPS, final_state, losses, max_rel_diff, run, run_and_kill, train_args

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not NVME, reason="NVMe offload needs libaio (apt-get install libaio-dev) and DeepSpeed's async_io op, whose "
                     "6+ minute build does not fit the suite's time budget: build it once or set BATON_TEST_NVME=1")]


def test_nvme_offload_swaps_and_computes_what_cpu_offload_does(runs):
    nvme, cpu = runs.get("z3-nvme-2"), runs.get("z3-cpu-wider-2")
    swapped = list((nvme / "swap").rglob("*.swp"))
    assert {p.parent.name for p in swapped} >= {"rank0", "rank1"}, "nothing was swapped to NVMe"
    assert losses(nvme) == losses(cpu)
    got, want = final_state(nvme), final_state(cpu)
    for key in ("weights", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(getattr(got, key)[k], getattr(want, key)[k]) for k in want.weights), key


def test_killed_nvme_run_resumes_to_the_same_weights(runs, tmp_path):
    reference = runs.get("z3-nvme-2")
    nproc, overrides = MODES["z3-nvme-2"]
    out = tmp_path / "run"
    args = train_args(runs.recipe, out, overrides)
    marker = out / "checkpoints" / f"step_{CKPT_STEP:08d}" / "trainer_state.json"
    run_and_kill(nproc, args, marker, tmp_path / "killed.log")
    assert not (out / "checkpoints" / f"step_{STEPS:08d}").exists(), "the run finished before it was killed"
    run(nproc, args, tmp_path / "resumed.log")
    got, want = final_state(out), final_state(reference)
    for key in ("weights", "exp_avg", "exp_avg_sq"):
        assert max_rel_diff(getattr(got, key), getattr(want, key)) <= 1e-6, key
    assert max(abs(a - b) / abs(b) for a, b in zip(losses(out), losses(reference))) <= 1e-6


def test_nvme_checkpoint_resumes_at_another_world_size(runs, tmp_path):
    reference = runs.get("z3-nvme-2")
    out = tmp_path / "run"
    overrides = [*MODES["z3-nvme-2"][1], f"checkpoint.resume={reference / 'checkpoints' / f'step_{CKPT_STEP:08d}'}"]
    run(1, train_args(runs.recipe, out, overrides), tmp_path / "resumed.log")
    got, want = final_state(out), final_state(reference)
    for key in ("weights", "exp_avg", "exp_avg_sq"):
        assert max_rel_diff(getattr(got, key), getattr(want, key)) < 1e-5, key
