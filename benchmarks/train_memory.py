"""Memory per rank and step time at world size 2: DDP vs ZeRO-1/2/3 vs CPU offload.

Each mode runs in its own 2-rank torchrun group (so RSS is that mode's alone) on a ~17M-parameter
model. Reported per rank: parameter / gradient / optimizer bytes by where they live
(accelerator, host, NVMe) against ZeRO's fp32 accounting (4 bytes each of weights and gradients
plus 8 of Adam moments = 16 bytes per parameter, i.e. 16Ψ, sharded to 8Ψ+8Ψ/N at stage 1,
4Ψ+12Ψ/N at stage 2, 16Ψ/N at stage 3), peak RSS, and the fastest step time.

On a CPU-only machine the accelerator IS host memory, so offload cannot lower RSS here: the
table accounts bytes by where they would live on a GPU machine. ZeRO-3 + NVMe is added when
libaio is installed (its swap folder is runs/bench_nvme_swap).

    .venv/bin/python benchmarks/train_memory.py [--steps 6]

Writes benchmarks/results/train_memory.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 256,
}
DS = ["backend=deepspeed"]
MODES = {
    "DDP": [],
    "ZeRO-1": [*DS, "deepspeed.stage=1"],
    "ZeRO-2": [*DS, "deepspeed.stage=2"],
    "ZeRO-3": [*DS, "deepspeed.stage=3"],
    "ZeRO-2 + CPU offload": [*DS, "deepspeed.stage=2", "deepspeed.offload_optimizer=cpu"],
    "ZeRO-3 + CPU offload (params + opt)": [
        *DS,
        "deepspeed.stage=3",
        "deepspeed.offload_optimizer=cpu",
        "deepspeed.offload_param=cpu",
    ],
}
NVME_MODE = {
    "ZeRO-3 + NVMe offload (params + opt)": [
        *DS,
        "deepspeed.stage=3",
        "deepspeed.offload_optimizer=nvme",
        "deepspeed.offload_param=nvme",
        f"deepspeed.nvme_path={ROOT / 'runs' / 'bench_nvme_swap'}",
    ]
}


def nvme_available() -> bool:
    """libaio present, so DeepSpeed's async_io op can be built (once, ~6 min or more)."""
    import ctypes.util

    return ctypes.util.find_library("aio") is not None


def theory(stage: int, psi: int, n: int) -> dict[str, float]:
    """ZeRO's per-rank bytes for fp32 training with Adam (weights 4, grads 4, moments 8 per parameter)."""
    shard = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[stage]
    return {"params": 4 * psi / shard[0], "grads": 4 * psi / shard[1], "optimizer": 8 * psi / shard[2]}


def worker(mode: str, steps: int, out: str) -> None:
    from baton.common.config import ModelConfig
    from baton.common.model import build_model
    from baton.train.backends import build_backend
    from baton.train.recipe import config_from_dict
    from baton.train.distributed import init_distributed
    from baton.train.recompute import apply_recompute

    cfg = config_from_dict(
        {"model": MODEL, "data": {"seq_len": 128}, "micro_batch_size": 4},
        {**MODES, **NVME_MODE}[mode] + ["optim.warmup_steps=0"],
    )
    dist = init_distributed(need_group=cfg.backend == "deepspeed")
    model = build_model(ModelConfig(**MODEL), seed=0)
    backend = build_backend(cfg, model, apply_recompute(model, cfg.recompute), dist)
    gen = torch.Generator().manual_seed(dist.rank)
    times = []
    for i in range(steps + 2):
        batch = torch.randint(0, MODEL["vocab_size"], (cfg.micro_batch_size, 129), generator=gen)
        t0 = time.perf_counter()
        backend.train_step([batch], 1e-4)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    report = backend.memory()
    report["rss_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["step_s"] = min(times)  # other jobs on a shared machine only ever add time
    reports = dist.all_gather_object(report)
    if dist.is_main:
        Path(out).write_text(json.dumps({"mode": mode, "ranks": reports}))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    names = [r["mode"] for r in rows]
    bottom = [0.0] * len(rows)
    for loc, hatch in (("accelerator", ""), ("host", "//"), ("nvme", "xx")):
        for kind, color in (("params", "C0"), ("master_params", "C4"), ("grads", "C1"), ("optimizer", "C2")):
            vals = [r["bytes"][loc].get(kind, 0) / 2**20 for r in rows]
            if any(vals):
                a.bar(
                    names, vals, bottom=bottom, color=color, hatch=hatch, edgecolor="k", lw=0.3, label=f"{kind} ({loc})"
                )
                bottom = [x + y for x, y in zip(bottom, vals)]
    a.plot(names, [r["theory_total"] / 2**20 for r in rows], "k_", ms=30, mew=2, label="ZeRO accounting (16Ψ...)")
    a.set(ylabel="MiB per rank (model state)", title="Model state per rank, world size 2")
    a.tick_params(axis="x", rotation=20, labelsize=8)
    a.legend(fontsize=7, ncol=2)
    b.barh(names, [r["step_s"] * 1000 for r in rows], color="C7")
    b.set(xlabel="ms per step", title="step time")
    b.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.out)
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    rows = []
    modes = {**MODES, **(NVME_MODE if nvme_available() else {})}
    for mode, overrides in modes.items():
        out = RESULTS / "train_memory.part.json.tmp"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                __file__,
                "--worker",
                mode,
                "--steps",
                str(args.steps),
                "--out",
                str(out),
            ],
            env=env,
            check=True,
        )
        rank0 = json.loads(out.read_text())["ranks"][0]
        out.unlink()
        stage = next((int(o.split("=")[1]) for o in overrides if o.startswith("deepspeed.stage")), 0)
        psi = rank0.pop("parameters")
        th = theory(stage, psi, 2)
        rows.append(
            {
                "mode": mode,
                "stage": stage,
                "parameters": psi,
                "bytes": {k: rank0[k] for k in ("accelerator", "host", "nvme")},
                "theory": th,
                "theory_total": sum(th.values()),
                "rss_peak_bytes": rank0["rss_peak_bytes"],
                "step_s": rank0["step_s"],
            }
        )
    (RESULTS / "train_memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, RESULTS / "train_memory.png")
    mib = lambda x: f"{x / 2**20:.1f}"  # noqa: E731
    print(f"\nΨ = {rows[0]['parameters']:,} parameters, world size 2, fp32 + Adam; MiB per rank\n")
    print(
        "| mode | params | fp32 master | grads | optimizer | on accelerator | on host | on NVMe | ZeRO accounting | peak RSS "
        "| step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["bytes"]
        tot = lambda k: sum(b[loc].get(k, 0) for loc in b)  # noqa: E731
        print(
            f"| {r['mode']} | {mib(tot('params'))} | {mib(tot('master_params'))} | {mib(tot('grads'))} | "
            f"{mib(tot('optimizer'))} | {mib(sum(b['accelerator'].values()))} | {mib(sum(b['host'].values()))} | "
            f"{mib(sum(b['nvme'].values()))} | {mib(r['theory_total'])} | {mib(r['rss_peak_bytes'])} | "
            f"{r['step_s'] * 1000:.0f} ms |"
        )


if __name__ == "__main__":
    main()
