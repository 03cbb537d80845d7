"""MoE training with and without expert parallelism on this machine: an 8-expert, top-2 model at
world size 2 (gloo), tokens/s, model state and peak RSS per rank, and the bytes each rank hands to
every kind of collective per step.

Layouts: FSDP2 over dp=2 (every expert sharded over both ranks: each layer all-gathers all 8
experts forward and backward and reduce-scatters their gradients), the same with EP=2 (each rank
holds 4 experts whole: tokens go to them and back by all_to_all_single, the experts' weights never
move), and DDP (replicated, gradients all-reduced). Each layout runs in a fresh torchrun launch (so
the peak RSS is its own), after two warm-up steps, one thread per rank; rounds alternate the
layouts so all see the same load on a shared machine, and the median round is reported (every
round's tokens/s is in the JSON).

Collective bytes are counted by wrapping torch.distributed's all_gather_single /
all_gather_into_tensor, reduce_scatter_single / reduce_scatter_tensor, all_reduce and
all_to_all_single (what FSDP2, DDP and the EP dispatch call): the size of the tensor each rank puts
in (DDP's bucketed all-reduce runs in its C++ reducer, so its row shows the gradient bytes that
reducer all-reduces, not a count). On CPU with gloo every collective is a loopback copy on the same two cores, so this measures
overheads, not a GPU cluster; the bytes are the part that carries over.

    .venv/bin/python benchmarks/train_moe.py [--rounds 5] [--steps 6] [--smoke] [--out DIR]

Writes DIR (default benchmarks/results)/train_moe.{json,png} and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WARMUP = 2
MODELS = {
    "full": dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "smoke": dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
}
SEQ = {"full": 256, "smoke": 32}
MICRO = 4  # sequences per rank per step (one micro-batch)
LAYOUTS = {
    "FSDP2 dp=2": dict(dp=2),
    "FSDP2 dp=2, EP=2": dict(dp=2, ep=2),
    "DDP dp=2": dict(dp=2, dp_mode="ddp"),
}
COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
)


def count_collectives(sent: dict[str, int]) -> None:
    """Wrap torch.distributed's collectives to add the bytes of each call's input to `sent` (the
    outermost call only: one collective may be implemented by another)."""
    depth = [0]
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            if sent.get("on") and depth[0] == 0:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                src = tensors[0] if _name == "all_reduce" else tensors[1]  # the others take (output, input)
                sent[_name] = sent.get(_name, 0) + src.numel() * src.element_size()
            depth[0] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(dist, name, wrapped)


def worker(spec: dict) -> None:
    from baton.common.config import ModelConfig
    from baton.common.model import build_model
    from baton.train.config import OptimConfig
    from baton.train.moe import attach_router_losses
    from baton.train.parallel.layout import ParallelConfig, check_layout
    from baton.train.parallel.mesh import build_mesh
    from baton.train.parallel.parallelize import Parallel3D

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sent: dict = defaultdict(int)
    count_collectives(sent)
    try:
        cfg, seq = ModelConfig(**MODELS[spec["model"]]), SEQ[spec["model"]]
        layout = check_layout(ParallelConfig(**LAYOUTS[spec["layout"]]), cfg, world, 1, seq)
        model = build_model(cfg, seed=0)
        attach_router_losses(model, 0.01, 0.001, 1)
        engine = Parallel3D(model, build_mesh(layout), 1, OptimConfig(lr=1e-3))
        g = torch.Generator().manual_seed(rank)
        times = []
        for step in range(WARMUP + spec["steps"]):
            rows = torch.randint(0, cfg.vocab_size, (MICRO, seq + 1), generator=g)
            sent["on"] = step >= WARMUP
            dist.barrier()
            t0 = time.perf_counter()
            engine.forward_backward([rows])
            engine.clip_and_step(1e-3, 1.0, True)
            sent["on"] = False
            dist.barrier()
            if step >= WARMUP:
                times.append(time.perf_counter() - t0)
        state = engine.memory()["accelerator"]
        if engine.data_parallel and layout.dp_mode == "ddp":  # its reducer all-reduces in C++, unseen here
            sent["ddp_reducer_all_reduce (= gradient bytes)"] = state["grads"] * spec["steps"]
        result = {
            "step_s": statistics.median(times),
            "tokens_per_s": world * MICRO * seq / statistics.median(times),
            "model_state_bytes": sum(state.values()),
            "param_bytes": state["params"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "collective_bytes_per_step": {k: v / spec["steps"] for k, v in sent.items() if k != "on"},
        }
        Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def launch(spec: dict, tmp: Path) -> list[dict]:
    from baton.train.distributed import free_port

    out = tmp / f"{spec['layout']}-{spec['round']}".replace(" ", "_").replace(",", "").replace("=", "")
    out.mkdir(parents=True)
    spec = {**spec, "out": str(out)}
    job = out / "job.json"
    job.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    proc = subprocess.run([*cmd, __file__, "--worker", str(job)], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['layout']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, one round of 2 steps (CI)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker.read_text()))
    model, rounds, steps = ("smoke", 1, 2) if args.smoke else ("full", args.rounds, args.steps)
    runs: dict[str, list[list[dict]]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name in LAYOUTS:
                runs[name].append(launch(dict(layout=name, model=model, steps=steps, round=r), Path(tmp)))
    rows = []
    for name, rounds_ in runs.items():
        mid = sorted(rounds_, key=lambda ranks: ranks[0]["tokens_per_s"])[len(rounds_) // 2]  # the median round
        rows.append(
            {
                "layout": name,
                "tokens_per_s": mid[0]["tokens_per_s"],
                "tokens_per_s_all_rounds": [ranks[0]["tokens_per_s"] for ranks in rounds_],
                "step_s": mid[0]["step_s"],
                "model_state_mb": [x["model_state_bytes"] / 2**20 for x in mid],
                "param_mb": [x["param_bytes"] / 2**20 for x in mid],
                "peak_rss_mb": [x["peak_rss_bytes"] / 2**20 for x in mid],
                "collective_mb_per_step": {k: v / 2**20 for k, v in mid[0]["collective_bytes_per_step"].items()},
            }
        )
    cfg = MODELS[model]
    result = {
        "model": cfg,
        "seq_len": SEQ[model],
        "tokens_per_rank_per_step": MICRO * SEQ[model],
        "world_size": 2,
        "steps": steps,
        "rounds": rounds,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_moe.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "train_moe.png")
    print("| layout | tokens/s | step s | model state MB/rank | peak RSS MB/rank | collective MB/step/rank |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        comm = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["collective_mb_per_step"].items()) if v)
        print(
            f"| {r['layout']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | "
            f"{max(r['model_state_mb']):.1f} | {max(r['peak_rss_mb']):.0f} | {comm} |"
        )


def plot(result: dict, path: Path) -> None:
    """Tokens/s (left), memory per rank (middle), collective bytes per step by kind (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["layout"] for r in rows]
    fig, (a, m, c) = plt.subplots(1, 3, figsize=(15, 3.2))
    a.barh(names, [r["tokens_per_s"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    a.set_xlabel("tokens/s (2 ranks, gloo, CPU)")
    y = range(len(rows))
    m.barh([i - 0.2 for i in y], [max(r["model_state_mb"]) for r in rows], 0.4, label="model state")
    m.barh([i + 0.2 for i in y], [max(r["peak_rss_mb"]) for r in rows], 0.4, label="peak RSS")
    m.set_yticks(list(y), [""] * len(rows))
    m.set_xlabel("MB, largest rank")
    m.legend(fontsize=8)
    kinds = sorted({k for r in rows for k, v in r["collective_mb_per_step"].items() if v})
    left = [0.0] * len(rows)
    for i, k in enumerate(kinds):
        vals = [r["collective_mb_per_step"].get(k, 0.0) for r in rows]
        c.barh(list(y), vals, left=left, label=k, color=f"C{i + 3}")
        left = [a_ + b_ for a_, b_ in zip(left, vals)]
    c.set_yticks(list(y), [""] * len(rows))
    c.set_xlabel("MB handed to collectives per step, rank 0")
    c.legend(fontsize=7)
    n = result["model"]
    fig.suptitle(
        f"MoE training, {n['num_local_experts']} experts top-{n['num_experts_per_tok']}, "
        f"{result['tokens_per_rank_per_step']} tokens/rank/step"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
