"""Train one tiny model on one fixed data stream at several parallel layouts (run by torchrun).

Usage: harness.py OUT CASE [CASE ...]. Every case of the launch's world size runs in the same
process group, one after another; each writes OUT/CASE/rank{r}.pt with its per-step losses and
gradient norms and, from the ranks that together hold one copy of the model (dp = cp = tp rank 0,
every pipeline stage), the whole gradients of every step and the final weights. The tests compare
them with a plain single-process run of the same model and data (reference.py).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.train.config import OptimConfig, RecomputeConfig
from baton.train.parallel import checkpoint
from baton.train.parallel.context_parallel import RingAttention, zigzag_shard
from baton.train.parallel.layout import ParallelConfig, check_layout
from baton.train.parallel.mesh import build_mesh
from baton.train.parallel.parallelize import Parallel3D

# 4 layers (PP=4, or 2 ranks x 2 virtual stages), 4 query / 2 key-value heads (GQA split by TP=2),
# a vocabulary of 128 (vocab-parallel), 16 tokens (2 x cp x tp chunks for zigzag CP + SP).
MODEL = ModelConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
SEQ, GLOBAL_BATCH, MICRO_BATCHES, STEPS, SAVE_AT = 16, 8, 4, 12, 6
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1)
CLIP = 1.0

CASES: dict[str, dict] = {
    # world size 2
    "tp2": dict(world=2, par=dict(tp=2, sequence_parallel=False)),
    "tp2_sp": dict(world=2, par=dict(tp=2), recompute="selective"),
    "pp2_1f1b": dict(world=2, par=dict(pp=2)),
    "pp2_gpipe": dict(world=2, par=dict(pp=2, pp_schedule="gpipe")),
    "pp2_interleaved": dict(world=2, par=dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2)),
    "dp2_fsdp": dict(world=2, par=dict(dp=2), recompute="full"),
    "dp2_ddp": dict(world=2, par=dict(dp=2, dp_mode="ddp")),
    "cp2": dict(world=2, par=dict(cp=2), recompute="selective"),
    "resume_dp2": dict(world=2, par=dict(dp=2), resume="tp2_pp2"),
    # world size 4
    "pp4": dict(world=4, par=dict(pp=4)),
    "tp2_pp2": dict(world=4, par=dict(tp=2, pp=2), save=True),
    "tp2_dp2": dict(world=4, par=dict(tp=2, dp=2), recompute="full"),
    "cp2_tp2": dict(world=4, par=dict(cp=2, tp=2)),
    "dp2_pp2_interleaved": dict(world=4, par=dict(dp=2, pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2)),
    # world size 1: the same code path with every degree 1
    "resume_1": dict(world=1, par=dict(), resume="tp2_pp2"),
}


def batch(step: int) -> torch.Tensor:
    """[GLOBAL_BATCH, SEQ + 1] tokens for `step`: arithmetic progressions mod the vocabulary,
    which a small model learns, so the loss falls and the comparison means something."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 6, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % MODEL.vocab_size


def run_case(name: str, out: Path) -> None:
    spec, rank, world = CASES[name], dist.get_rank(), dist.get_world_size()
    layout = check_layout(ParallelConfig(**spec["par"]), MODEL, world, MICRO_BATCHES, SEQ)
    mesh = build_mesh(layout)
    engine = Parallel3D(
        build_model(MODEL, seed=0),
        mesh,
        MICRO_BATCHES,
        OPTIM,
        recompute=RecomputeConfig(mode=spec.get("recompute", "none")),
    )
    start = 0
    if "resume" in spec:
        ckpt = out / spec["resume"] / f"step_{SAVE_AT}"
        checkpoint.load(engine, ckpt)
        start = json.loads((ckpt / "position.json").read_text())["step"]  # the data position
    holder = mesh.rank("dp") == mesh.rank("cp") == mesh.rank("tp") == 0
    rec: dict = {"start": start, "losses": [], "norms": [], "grads": [], "weights_before": []}
    per = GLOBAL_BATCH // layout.dp
    for step in range(start, STEPS):
        rows = batch(step)[mesh.rank("dp") * per : (mesh.rank("dp") + 1) * per]
        weights = engine.full_parameters()  # collective
        loss = engine.forward_backward(list(rows.chunk(MICRO_BATCHES)))
        dist.all_reduce(loss, group=mesh.group("dp"))
        grads = engine.full_gradients()
        _, norm = engine.clip_and_step(OPTIM.lr, CLIP, True)
        rec["losses"].append(loss.item() / layout.dp)
        rec["norms"].append(norm)
        rec["grads"].append(grads if holder else {})
        rec["weights_before"].append(weights if holder else {})
        if spec.get("save") and step + 1 in (SAVE_AT, STEPS):
            ckpt = out / name / f"step_{step + 1}"
            checkpoint.save(engine, ckpt)
            if rank == 0:
                (ckpt / "position.json").write_text(json.dumps({"step": step + 1}))
    rec["weights"] = engine.full_parameters()  # collective: every rank takes part
    rec["memory"] = engine.memory()
    if not holder:
        rec["grads"], rec["weights_before"], rec["weights"] = [], [], {}
    torch.save(rec, out / name / f"rank{rank}.pt")


def run_ring(out: Path) -> None:
    """Ring attention (causal, zigzag) against SDPA on the whole sequence, forward and backward,
    in float64 so that any difference is a bug, not rounding."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 2, 32, 4, 2, 8
    q, k, v, dout = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    layer = types.SimpleNamespace(scaling=d**-0.5, sliding_window=None)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in full), is_causal=True, scale=layer.scaling, enable_gqa=True
    ).transpose(1, 2)
    ref.backward(dout)
    local = [zigzag_shard(t, world, rank).clone().requires_grad_() for t in (q, k, v)]
    out_l = RingAttention(dist.group.WORLD)(*local, layer)
    out_l.backward(zigzag_shard(dout, world, rank))
    pairs = {
        "out": (out_l, ref),
        "dq": (local[0].grad, full[0].grad),
        "dk": (local[1].grad, full[1].grad),
        "dv": (local[2].grad, full[2].grad),
    }
    errors = {n: ((a - zigzag_shard(r, world, rank)).abs().max() / r.abs().max()).item() for n, (a, r) in pairs.items()}
    torch.save(errors, out / f"ring{world}" / f"rank{rank}.pt")


def main(out: Path, cases: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # a hang fails, not stalls
    try:
        for name in cases:
            name = f"ring{dist.get_world_size()}" if name == "ring" else name
            (out / name).mkdir(parents=True, exist_ok=True)
            run_ring(out) if name.startswith("ring") else run_case(name, out)
            gc.collect()
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), sys.argv[2:])
