"""Mixed precision on this CPU: tokens/s of `baton train` in fp32, bf16 (and fp16) for the plain
backend (one process) and two sharded ones (FSDP2 and DeepSpeed ZeRO-2, two ranks over gloo),
same model, data and global batch, one thread per rank, plus the raw matmul rate of each dtype.

The CPU has AVX-512 BF16 and AMX (BF16/INT8 tiles) but no AMX-FP16, so bf16 matmuls take the AMX
path in oneDNN and fp16 only AVX-512 FP16: measured, not assumed. Throughput is the trainer's own
(training steps only), over the steps after the first WARMUP (oneDNN primitive creation, autocast's
weight-cast cache), from its per-step elapsed time. Precisions alternate within each round in one
process group, so all see the same load on a shared machine; the median round is reported.

    .venv/bin/python benchmarks/train_precision.py [--rounds 3] [--steps 14] [--models demo wide]

Writes benchmarks/results/train_precision.{json,png} and prints a markdown table.
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"  # beside the checkout, as configs/ say
WARMUP = 4
MODELS = {  # decoder shapes; the vocabulary is the char tokenizer's (65)
    "demo": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4),
    "wide": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8),
}
SEQ, MICRO, GLOBAL = 256, 8, 16
# backend -> (processes, overrides, precisions)
BACKENDS = {
    "torch": (1, [], ("fp32", "bf16", "fp16")),
    "fsdp2": (2, ["backend=torch3d", "parallel.dp=2"], ("fp32", "bf16")),
    "zero2": (2, ["backend=deepspeed", "deepspeed.stage=2"], ("fp32", "bf16", "fp16")),
}


def recipe(model: str, corpus: Path, cache: Path) -> dict:
    return {
        "model": {**MODELS[model], "max_position_embeddings": SEQ},
        "data": {"path": str(corpus), "seq_len": SEQ, "val_fraction": 0.05, "cache_dir": str(cache)},
        "tokenizer": {"kind": "char"},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2},
        "micro_batch_size": MICRO,
        "global_batch_size": GLOBAL,
        "eval_interval": 0,
        "eval_batches": 1,
        "log_interval": 1,
        "export": False,
        "checkpoint": {"resume": "never"},
        "logging": {"progress": False, "mfu": False, "plot": False, "tensorboard": False},
    }


def worker(job: Path) -> None:
    """One launch (torchrun or a lone process): every round x precision of one backend and model."""
    from baton.train.recipe import config_from_dict
    from baton.train.distributed import init_distributed
    from baton.train.trainer import train

    spec = json.loads(job.read_text())
    dist = init_distributed(need_group=True)
    out: list[dict] = []
    for r in range(spec["rounds"]):
        for precision in spec["precisions"]:
            run_dir = Path(spec["root"]) / f"{precision}-{r}"
            overrides = [
                *spec["overrides"],
                f"precision={precision}",
                f"max_steps={spec['steps']}",
                f"out_dir={run_dir}",
            ]
            result = train(config_from_dict(spec["recipe"], overrides))
            if dist.is_main:
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                t0, t1 = records[WARMUP - 1]["elapsed_s"], records[-1]["elapsed_s"]
                tokens = (len(records) - WARMUP) * GLOBAL * SEQ
                out.append(
                    {
                        "round": r,
                        "precision": precision,
                        "tokens_per_s": tokens / (t1 - t0),
                        "loss": result.final_train_loss,
                    }
                )
    if dist.is_main:
        job.with_suffix(".out.json").write_text(json.dumps(out))


def launch(backend: str, model: str, rounds: int, steps: int, tmp: Path) -> list[dict]:
    nproc, overrides, precisions = BACKENDS[backend]
    job = tmp / f"{backend}-{model}.json"
    spec = dict(
        recipe=recipe(model, CORPUS, tmp / "datasets"),
        overrides=overrides,
        precisions=precisions,
        rounds=rounds,
        steps=steps,
        root=str(tmp / f"{backend}-{model}"),
    )
    job.write_text(json.dumps(spec))
    from baton.train.distributed import free_port

    cmd = [sys.executable, __file__, "--worker", str(job)]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            *cmd[1:],
        ]
    # One thread per rank: on a machine shared with other jobs more threads than free cores spin and
    # wait, which hides what the dtype does (the ranks of a 2-rank job then use both cores).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{backend}/{model} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(job.with_suffix(".out.json").read_text())


def matmul_rates(n: int = 1024, seconds: float = 1.0) -> dict[str, float]:
    """GFLOP/s of an n x n matmul per dtype on one thread, as a rank runs (best of bursts)."""
    torch.set_num_threads(1)
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(3):
            a @ b
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
        rates[name] = best / 1e9
    return rates


def profile_step(model: str) -> dict[str, dict[str, float]]:
    """Where one plain training step's time goes (torch.profiler, self CPU ms by op family), fp32 vs
    bf16 under autocast, one thread, after warm-up steps: the part bf16 speeds up is the matmuls."""
    from torch.profiler import ProfilerActivity, profile

    from baton.common.config import ModelConfig
    from baton.common.model import build_model
    from baton.train.backends import autocast, lm_loss

    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=65, **MODELS[model], max_position_embeddings=SEQ)
    batch = torch.randint(0, 65, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0))
    families = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm"), "attention": ("scaled_dot_product",)}
    families["casts"] = ("aten::copy_", "aten::_to_copy")
    out = {}
    for precision in ("fp32", "bf16"):
        m = build_model(cfg, seed=0)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

        def step() -> None:
            with autocast(torch.device("cpu"), precision):
                loss = lm_loss(m(batch[:, :-1]), batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        ms = {k: 0.0 for k in (*families, "other")}
        for e in prof.key_averages():
            family = next((f for f, keys in families.items() if any(k in e.key for k in keys)), "other")
            ms[family] += e.self_cpu_time_total / 1e3
        out[precision] = {**ms, "total": sum(ms.values())}
    return out


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(summary["throughput"])
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 4))
    colors = {"fp32": "tab:gray", "bf16": "tab:blue", "fp16": "tab:orange"}
    for ax, model in zip(axes, models):
        rows = summary["throughput"][model]
        backends = list(rows)
        for i, precision in enumerate(("fp32", "bf16", "fp16")):
            xs = [j + 0.27 * (i - 1) for j, b in enumerate(backends) if precision in rows[b]]
            ys = [rows[b][precision]["tokens_per_s"] for b in backends if precision in rows[b]]
            ax.bar(xs, ys, width=0.27, color=colors[precision], label=precision)
        ax.set_xticks(
            range(len(backends)), [f"{b}\n({BACKENDS[b][0]} rank{'s' * (BACKENDS[b][0] > 1)})" for b in backends]
        )
        ax.set_ylabel("tokens/s (whole job)")
        ax.set_title(f"{model}: {summary['params'][model] / 1e6:.1f}M params, seq {SEQ}, batch {GLOBAL}")
        ax.legend(loc="upper left", fontsize=8)
    ax = axes[-1]
    rates = summary["matmul_gflops"]
    ax.bar(list(rates), list(rates.values()), color=[colors[k] for k in rates])
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"{summary['matmul_n']}x{summary['matmul_n']} matmul, one thread")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    from baton.common.config import ModelConfig

    summary: dict = {
        "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?"),
        "cores": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(),
        "seq_len": SEQ,
        "global_batch": GLOBAL,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup_steps_excluded": WARMUP,
        "torch": torch.__version__,
        "matmul_n": 1024,
        "matmul_threads": 1,
        "matmul_gflops": matmul_rates(),
        "params": {
            m: ModelConfig(vocab_size=65, **MODELS[m], max_position_embeddings=SEQ).num_parameters()
            for m in args.models
        },
        "throughput": {},
        "rounds_raw": {},
        "profile_plain_step_ms": {m: profile_step(m) for m in args.models},
    }
    with tempfile.TemporaryDirectory(prefix="bench_precision_") as tmp:
        for model in args.models:
            summary["throughput"][model], summary["rounds_raw"][model] = {}, {}
            for backend in args.backends:
                rows = launch(backend, model, args.rounds, args.steps, Path(tmp))
                summary["rounds_raw"][model][backend] = rows
                per = {}
                for precision in BACKENDS[backend][2]:
                    mine = [r for r in rows if r["precision"] == precision]
                    per[precision] = {
                        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                        "final_loss": statistics.median(r["loss"] for r in mine),
                    }
                for precision in per:
                    per[precision]["vs_fp32"] = per[precision]["tokens_per_s"] / per["fp32"]["tokens_per_s"]
                summary["throughput"][model][backend] = per
                print(model, backend, {k: round(v["tokens_per_s"]) for k, v in per.items()}, flush=True)
    summary["load_avg_at_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "train_precision.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, RESULTS / "train_precision.png")
    print("\n| model | backend | fp32 tok/s | bf16 tok/s (x fp32) | fp16 tok/s (x fp32) |\n|---|---|---|---|---|")
    for model, rows in summary["throughput"].items():
        for backend, per in rows.items():
            cell = lambda p: f"{per[p]['tokens_per_s']:,.0f} ({per[p]['vs_fp32']:.2f}x)" if p in per else "-"  # noqa: E731
            print(f"| {model} | {backend} | {per['fp32']['tokens_per_s']:,.0f} | {cell('bf16')} | {cell('fp16')} |")
    print("matmul GFLOP/s:", {k: round(v) for k, v in summary["matmul_gflops"].items()})
    for model, prof in summary["profile_plain_step_ms"].items():
        print(
            f"plain step of {model}, ms by op family:",
            {p: {k: round(v) for k, v in d.items()} for p, d in prof.items()},
        )


if __name__ == "__main__":
    main()
