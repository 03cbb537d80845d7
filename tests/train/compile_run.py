"""Run by torchrun (2 ranks): the parallel harness's tiny model under Parallel3D with and without
compiled layers (inductor) at FSDP2 with full recomputation, FSDP2 in bf16, a 2-stage pipeline,
context parallelism with selective recomputation and tensor parallelism (with sequence parallelism
and full recomputation, and without it under selective recomputation); writes OUT/<case>.rank<r>.pt with the per-step
losses, gradient norms and parameter names of both runs (tests/train/test_compile.py compares them)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent / "parallel"))
from harness import MICRO_BATCHES, MODEL, OPTIM, SEQ, batch  # noqa: E402

from baton.common.model import build_model  # noqa: E402
from baton.train.config import RecomputeConfig  # noqa: E402
from baton.train.parallel.layout import ParallelConfig, check_layout  # noqa: E402
from baton.train.parallel.mesh import build_mesh  # noqa: E402
from baton.train.parallel.parallelize import Parallel3D  # noqa: E402

CASES = {
    "fsdp2_full": (dict(dp=2), "full", "fp32"),
    "fsdp2_bf16": (dict(dp=2), "none", "bf16"),
    "pp2": (dict(pp=2), "none", "fp32"),
    "cp2_selective": (dict(cp=2), "selective", "fp32"),
    # vocab-parallel embedding: layer 0's input is an in-flight collective (train/compile.py)
    "tp2_sp_full": (dict(tp=2), "full", "fp32"),
    "tp2_selective": (dict(tp=2, sequence_parallel=False), "selective", "fp32"),
}
STEPS = 3


def run(par: dict, recompute: str, precision: str, compile: str | None) -> dict:
    # One training job per process in real use: each case starts from empty dynamo caches (six cases'
    # graphs piled up in one process ran into a RecursionError in proxy tracing).
    torch._dynamo.reset()
    layout = check_layout(ParallelConfig(**par), MODEL, dist.get_world_size(), MICRO_BATCHES, SEQ)
    mesh = build_mesh(layout)
    engine = Parallel3D(
        build_model(MODEL, seed=0),
        mesh,
        MICRO_BATCHES,
        OPTIM,
        recompute=RecomputeConfig(recompute),
        precision=precision,
        compile=compile,
    )
    losses, norms = [], []
    per = batch(0).shape[0] // layout.dp
    for step in range(STEPS):
        rows = batch(step)[mesh.rank("dp") * per : (mesh.rank("dp") + 1) * per]
        loss = engine.forward_backward(list(rows.chunk(MICRO_BATCHES)))
        dist.all_reduce(loss, group=mesh.group("dp"))
        _, norm = engine.clip_and_step(OPTIM.lr, 1.0, True)
        losses.append(loss.item() / layout.dp)
        norms.append(norm)
    names = [n for n, _ in engine.named_parameters()]
    return {"losses": losses, "norms": norms, "names": names}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for name, (par, recompute, precision) in CASES.items():
        rec = {mode: run(par, recompute, precision, mode) for mode in (None, "inductor")}
        torch.save(rec, out / f"{name}.rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
