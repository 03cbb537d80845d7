"""Backend megatron (megatron-core 0.16.1) next to Baton's torch-native torch3d backend at the same
layouts on this CPU: tokens/s of `baton train` and model-state memory per rank.

Both run the same recipe through the same trainer (data, model, optimizer, global batch), on two
ranks over gloo with one thread each; only the backend and its layout section differ. Layouts:
dp=2 replicated (torch3d dp_mode ddp / megatron DDP), dp=2 sharded (FSDP2 / megatron's distributed
optimizer, which shards only the optimizer state), tp=2, tp=2 + sequence parallel, pp=2 (1F1B) and
pp=2 interleaved (2 virtual stages per rank). Throughput is the trainer's own (training steps only,
from the per-step elapsed time after WARMUP steps); memory is each rank's parameters + gradients +
optimizer state as the backend reports it, and the process's resident set after the run. Backends
alternate within each round in one process group, so both see the same load; the best round is
reported (the machine is shared).

    .venv/bin/python benchmarks/train_megatron.py [--rounds 2] [--steps 12] [--smoke]

Writes benchmarks/results/train_megatron.{json,png} (or --out) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
WARMUP = 3
MODEL = {  # vocab padded to 128 so that tp=2 splits it evenly (the char tokenizer has 65)
    "vocab_size": 128,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
}
SMOKE_MODEL = {**MODEL, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
SEQ, MICRO, GLOBAL = 128, 4, 16
# layout -> (torch3d overrides, megatron overrides): one parallel: section serves both backends
PP2_INTERLEAVED = ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"]
LAYOUTS = {
    "dp2": (["parallel.dp=2", "parallel.dp_mode=ddp"], []),
    "dp2_sharded": (["parallel.dp=2"], ["megatron.distributed_optimizer=true"]),
    "tp2": (
        ["parallel.tp=2", "parallel.sequence_parallel=false"],
        ["parallel.tp=2", "parallel.sequence_parallel=false"],
    ),
    "tp2_sp": (["parallel.tp=2"], ["parallel.tp=2"]),
    "pp2": (["parallel.pp=2"], ["parallel.pp=2"]),
    "pp2_interleaved": (PP2_INTERLEAVED, PP2_INTERLEAVED),
}
SMOKE_LAYOUTS = ("tp2",)


def recipe(model: dict, corpus: Path, cache: Path) -> dict:
    return {
        "model": model,
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
    """Under torchrun: every round x layout x backend, each a whole `baton train` run."""
    from baton.train.recipe import config_from_dict
    from baton.train.distributed import init_distributed
    from baton.train.trainer import Trainer

    warnings.filterwarnings("ignore")
    spec = json.loads(job.read_text())
    dist = init_distributed(need_group=True)
    out: list[dict] = []
    for r in range(spec["rounds"]):
        for layout in spec["layouts"]:
            for backend, overrides in zip(("torch3d", "megatron"), LAYOUTS[layout]):
                run_dir = Path(spec["root"]) / f"{layout}-{backend}-{r}"
                trainer = Trainer(
                    config_from_dict(
                        spec["recipe"],
                        [f"backend={backend}", *overrides, f"max_steps={spec['steps']}", f"out_dir={run_dir}"],
                    )
                )
                result = trainer.fit()
                mem = trainer.backend.memory()["accelerator"]
                state = [
                    int(x) for x in dist.all_gather_object(sum(mem.values()))
                ]  # params + grads + optimizer, per rank
                rss = dist.all_gather_object(psutil.Process().memory_info().rss)
                if dist.is_main:
                    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                    t0, t1 = records[WARMUP - 1]["elapsed_s"], records[-1]["elapsed_s"]
                    out.append(
                        {
                            "round": r,
                            "layout": layout,
                            "backend": backend,
                            "tokens_per_s": (len(records) - WARMUP) * GLOBAL * SEQ / (t1 - t0),
                            "losses": [rec["loss"] for rec in records],
                            "final_loss": result.final_train_loss,
                            "state_bytes_per_rank": state,
                            "rss_bytes_per_rank": rss,
                        }
                    )
                del trainer
    if dist.is_main:
        job.with_suffix(".out.json").write_text(json.dumps(out))


def launch(spec: dict, tmp: Path) -> list[dict]:
    from baton.train.distributed import free_port

    job = tmp / "job.json"
    job.write_text(json.dumps(spec))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        __file__,
        "--worker",
        str(job),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(job.with_suffix(".out.json").read_text())


def summarize(rows: list[dict]) -> dict:
    """Per layout and backend: the best round's tokens/s, its memory and losses."""
    best: dict = {}
    for row in rows:
        cell = best.setdefault(row["layout"], {})
        if row["backend"] not in cell or row["tokens_per_s"] > cell[row["backend"]]["tokens_per_s"]:
            cell[row["backend"]] = row
    return best


def table(best: dict) -> str:
    lines = [
        "| layout | backend | tokens/s | state MiB per rank | RSS MiB per rank | final loss |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for layout, cell in best.items():
        for backend, row in cell.items():
            state = " / ".join(f"{b / 2**20:.1f}" for b in row["state_bytes_per_rank"])
            rss = " / ".join(f"{b / 2**20:.0f}" for b in row["rss_bytes_per_rank"])
            lines.append(
                f"| {layout} | {backend} | {row['tokens_per_s']:,.0f} | {state} | {rss} | {row['final_loss']:.4f} |"
            )
    return "\n".join(lines)


def plot(best: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(best)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for i, (backend, color) in enumerate((("torch3d", "tab:gray"), ("megatron", "tab:green"))):
        xs = [j + 0.4 * (i - 0.5) for j in range(len(layouts))]
        ax1.bar(xs, [best[x][backend]["tokens_per_s"] for x in layouts], width=0.4, color=color, label=backend)
        mem = [max(best[x][backend]["state_bytes_per_rank"]) / 2**20 for x in layouts]
        ax2.bar(xs, mem, width=0.4, color=color, label=backend)
    for ax, label in ((ax1, "tokens/s (2 ranks)"), (ax2, "model state MiB, largest rank")):
        ax.set_xticks(range(len(layouts)), layouts, rotation=20)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--smoke", action="store_true", help="tiny model, one layout, one round (for tests)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    model = SMOKE_MODEL if args.smoke else MODEL
    rounds, steps = (1, WARMUP + 2) if args.smoke else (args.rounds, args.steps)
    layouts = list(SMOKE_LAYOUTS) if args.smoke else args.layouts
    with tempfile.TemporaryDirectory(prefix="bench_megatron_") as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(CORPUS.read_text()[: 200_000 if not args.smoke else 40_000])
        spec = {
            "recipe": recipe(model, corpus, Path(tmp) / "datasets"),
            "layouts": layouts,
            "rounds": rounds,
            "steps": steps,
            "root": str(Path(tmp) / "runs"),
        }
        load = os.getloadavg()
        rows = launch(spec, Path(tmp))
    best = summarize(rows)
    from baton.common.config import ModelConfig

    params = ModelConfig(**model).num_parameters()
    summary = {
        "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?"),
        "cores": os.cpu_count(),
        "load_avg_at_start": load,
        "model": model,
        "params": params,
        "seq_len": SEQ,
        "global_batch": GLOBAL,
        "rounds": rounds,
        "steps": steps,
        "warmup_steps_excluded": WARMUP,
        "ranks": 2,
        "best": best,
        "rounds_raw": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_megatron.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(best, args.out / "train_megatron.png", f"{params / 1e6:.2f}M params, seq {SEQ}, batch {GLOBAL}, 2 ranks")
    print(table(best))


if __name__ == "__main__":
    main()
