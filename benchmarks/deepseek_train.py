"""DeepSeek-V3 training with and without expert parallelism on this machine: a small DeepSeek-V3-shaped
model (multi-head latent attention with a low-rank query, a dense first layer, then 16 fine-grained
routed experts in 4 groups, top-4 from the best 2, one shared expert, one MTP module), trained as
`baton train` trains it - the sequence-wise balance loss, the correction biases moved after every
step from the loads summed over the ranks, the MTP loss - at world size 2 (gloo, one thread per rank).

Layouts: one process (the same per-rank batch: what a rank does alone), DDP dp=2 (replicated,
gradients all-reduced), FSDP2 dp=2 (every expert sharded over both ranks: each MoE layer all-gathers
its 16 experts forward and backward, reduce-scatters their gradients) and FSDP2 dp=2 with EP=2 (each
rank holds 8 experts whole; token rows go to them and back by all_to_all_single). Reported: tokens/s
over both ranks (the median of the timed steps, after two warm-up steps), model state per rank, and
the bytes each rank hands to each kind of collective per step (the outermost call's input; DDP's
bucketed all-reduce runs in its C++ reducer, unseen: its row shows only the balancer's). Each
layout runs in its own torchrun launch; rounds alternate the layouts, and the median round is kept
(every round's tokens/s is in the JSON). Two processes share this machine's two cores and every
collective is a loopback copy: this measures what EP saves in gathers against what its all-to-all
costs, not a GPU cluster's link speeds.

    .venv/bin/python benchmarks/deepseek_train.py [--rounds 3] [--steps 3] [--smoke] [--out DIR]

Writes DIR (default benchmarks/results)/deepseek_train.{json,png} and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
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
SHAPE = dict(
    model_type="deepseek_v3",
    num_attention_heads=8,
    first_k_dense_replace=1,
    num_local_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    num_nextn_predict_layers=1,
)
MODELS = {
    "full": dict(
        SHAPE,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=512,  # (experts whose weights outweigh the token rows they take: EP's regime)
        num_hidden_layers=3,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=512,
    ),
    "smoke": dict(
        SHAPE,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        max_position_embeddings=64,
    ),
}
SEQ = {"full": 128, "smoke": 32}
MICRO = 4  # sequences per rank per step (one micro-batch)
LAYOUTS = {  # name -> (processes, parallel section)
    "1 process": (1, dict()),
    "DDP dp=2": (2, dict(dp=2, dp_mode="ddp")),
    "FSDP2 dp=2": (2, dict(dp=2)),
    "FSDP2 dp=2, EP=2": (2, dict(dp=2, ep=2)),
}
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_to_all_single")  # (what FSDP2 calls)


def count_bytes(sent: dict[str, int]) -> None:
    """Add each collective call's input bytes to `sent` while sent["on"] (outermost calls only)."""
    inside = [0]
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            if sent.get("on") and not inside[0]:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                src = tensors[0] if _name == "all_reduce" else tensors[1]  # the others take (output, input)
                sent[_name] += src.numel() * src.element_size()
            inside[0] += 1
            try:
                return _fn(*args, **kwargs)
            finally:
                inside[0] -= 1

        setattr(dist, name, counted)


def worker(spec: dict) -> None:
    from baton.common.config import ModelConfig
    from baton.common.model import build_model
    from baton.train.balancing import attach_balancing
    from baton.train.config import OptimConfig
    from baton.train.moe import attach_router_losses
    from baton.train.mtp import MTPLoss
    from baton.train.parallel.layout import ParallelConfig, check_layout
    from baton.train.parallel.mesh import build_mesh
    from baton.train.parallel.parallelize import Parallel3D

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sent: dict = defaultdict(int)
    count_bytes(sent)
    try:
        cfg, seq = ModelConfig(**MODELS[spec["model"]]), SEQ[spec["model"]]
        layout = check_layout(ParallelConfig(**LAYOUTS[spec["layout"]][1]), cfg, world, 1, seq)
        model = build_model(cfg, seed=0)
        attach_router_losses(model, None, None, 1)  # DeepSeek-V3's sequence-wise loss at its default weight
        engine = Parallel3D(model, build_mesh(layout), 1, OptimConfig(lr=1e-3))
        balancer, mtp = attach_balancing(model, None, None), MTPLoss(model, 0.3, 1)
        g = torch.Generator().manual_seed(rank)
        times = []
        for step in range(WARMUP + spec["steps"]):
            rows = torch.randint(0, cfg.vocab_size, (MICRO, seq + 1), generator=g)
            sent["on"] = step >= WARMUP
            dist.barrier()
            t0 = time.perf_counter()
            mtp.feed([rows])
            engine.forward_backward([rows])
            engine.clip_and_step(1e-3, 1.0, True)
            balancer.step(True)
            sent["on"] = False
            dist.barrier()
            if step >= WARMUP:
                times.append(time.perf_counter() - t0)
        state = engine.memory()["accelerator"]
        result = {
            "step_s": statistics.median(times),
            "tokens_per_s": world * MICRO * seq / statistics.median(times),
            "model_state_bytes": sum(state.values()),
            "collective_bytes_per_step": {k: v / spec["steps"] for k, v in sent.items() if k != "on"},
            "moe_max_violation": balancer.metrics().get("moe_max_violation"),
        }
        Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def launch(spec: dict, tmp: Path) -> list[dict]:
    from baton.train.distributed import free_port

    out = tmp / f"{spec['layout']}-{spec['round']}".replace(" ", "_").replace(",", "").replace("=", "")
    out.mkdir(parents=True)
    spec = {**spec, "out": str(out)}
    (out / "job.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    procs = LAYOUTS[spec["layout"]][0]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={free_port()}"]
    proc = subprocess.run(
        [*cmd, __file__, "--worker", str(out / "job.json")], env=env, capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['layout']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(procs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, one round of 2 steps (CI)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker.read_text()))
    model, rounds, steps = ("smoke", 1, 2) if args.smoke else ("full", args.rounds, args.steps)
    runs: dict[str, list[list[dict]]] = {name: [] for name in LAYOUTS}
    t0 = time.perf_counter()
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
                "processes": LAYOUTS[name][0],
                "tokens_per_s": mid[0]["tokens_per_s"],
                "tokens_per_s_all_rounds": [ranks[0]["tokens_per_s"] for ranks in rounds_],
                "step_s": mid[0]["step_s"],
                "model_state_mb": [x["model_state_bytes"] / 2**20 for x in mid],
                "collective_mb_per_step": {k: v / 2**20 for k, v in mid[0]["collective_bytes_per_step"].items()},
            }
        )
    cfg = MODELS[model]
    params = sum(p.numel() for p in _meta_model(cfg).parameters())
    result = {
        "model": cfg,
        "parameters": params,
        "seq_len": SEQ[model],
        "tokens_per_rank_per_step": MICRO * SEQ[model],
        "steps": steps,
        "rounds": rounds,
        "wall_s": time.perf_counter() - t0,
        "load_average_after": os.getloadavg(),  # (other work on the machine skews every layout alike, round by round)
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "deepseek_train.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "deepseek_train.png")
    print(f"DeepSeek-V3-shaped, {params / 1e6:.2f}M parameters, {MICRO}x{SEQ[model]} tokens per rank per step")
    print("| layout | tokens/s | step s | model state MB/rank | collective MB/step/rank |")
    print("|---|---|---|---|---|")
    for r in rows:
        comm = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["collective_mb_per_step"].items()) if v)
        print(
            f"| {r['layout']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | "
            f"{max(r['model_state_mb']):.1f} | {comm or '-'} |"
        )


def _meta_model(cfg: dict) -> torch.nn.Module:
    from baton.common.config import ModelConfig
    from baton.common.model import CausalLM

    with torch.device("meta"):
        return CausalLM(ModelConfig(**cfg))


def plot(result: dict, path: Path) -> None:
    """Tokens/s (left), model state per rank (middle), collective bytes per step by kind (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names, y = [r["layout"] for r in rows], range(len(rows))
    fig, (a, m, c) = plt.subplots(1, 3, figsize=(15, 3.2))
    a.barh(names, [r["tokens_per_s"] for r in rows], color=[f"C{i}" for i in y])
    a.set_xlabel("training tokens/s (CPU, gloo, 1 thread per rank)")
    m.barh(list(y), [max(r["model_state_mb"]) for r in rows], color="C4")
    m.set_yticks(list(y), [""] * len(rows))
    m.set_xlabel("model state MB, largest rank")
    kinds = sorted({k for r in rows for k, v in r["collective_mb_per_step"].items() if v})
    left = [0.0] * len(rows)
    for i, k in enumerate(kinds):
        vals = [r["collective_mb_per_step"].get(k, 0.0) for r in rows]
        c.barh(list(y), vals, left=left, label=k, color=f"C{i + 5}")
        left = [a_ + b_ for a_, b_ in zip(left, vals)]
    c.set_yticks(list(y), [""] * len(rows))
    c.set_xlabel("MB handed to collectives per step, rank 0")
    c.legend(fontsize=7)
    n = result["model"]
    fig.suptitle(
        f"DeepSeek-V3-shaped training ({result['parameters'] / 1e6:.1f}M parameters, MLA, {n['num_local_experts']} "
        f"experts top-{n['num_experts_per_tok']}, MTP), {result['tokens_per_rank_per_step']} tokens/rank/step"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
