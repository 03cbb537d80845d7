"""compile: true on this CPU: tokens/s of the plain training step with every decoder layer compiled
(inductor) against eager, in fp32 and bf16, and the compile time it costs.

Each run builds the model and the plain backend (baton.train.backends.ddp, the code `baton train`
runs for one process) on random token blocks and times `train_step` - forward, backward, AdamW - one
thread. The first compiled step includes the compilation: compile time is that step's time minus a
steady compiled step. Steady tokens/s comes from the steps after WARMUP. Eager and compiled
alternate within each round on the same machine load; the best round is reported (the machine is
shared: the best is the nearest to idle). Round 1 compiles with a cold inductor cache (dynamo reset
and a fresh cache folder); later rounds reuse the on-disk FX graph cache, which is what a re-run of
the same recipe sees.

    .venv/bin/python benchmarks/train_compile.py [--rounds 3] [--steps 12] [--models demo wide]
    .venv/bin/python benchmarks/train_compile.py --smoke   # tiny model, aot_eager, 1 round (tests)

Writes benchmarks/results/train_compile.{json,png} (smoke: a temporary folder) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
WARMUP = 3
MODELS = {  # as benchmarks/train_precision.py; the char tokenizer's vocabulary of 65
    "demo": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4),
    "wide": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
}
SEQ, MICRO = 256, 8


def run(model: str, precision: str, compiled: bool, steps: int, backend: str, seq: int, micro: int) -> dict:
    """One fresh model trained `steps` steps; per-step seconds."""
    import torch._dynamo

    from baton.common.model import build_model
    from baton.train.compile import compile_layers
    from baton.train.backends.ddp import DDPBackend
    from baton.train.recipe import config_from_dict
    from baton.train.distributed import Dist
    from baton.train.recompute import apply_recompute

    cfg = config_from_dict(
        {
            "model": {**MODELS[model], "max_position_embeddings": seq, "vocab_size": 65},
            "data": {"seq_len": seq},
            "micro_batch_size": micro,
            "precision": precision,
            "compile": compiled and backend == "inductor",
        }
    )
    torch._dynamo.reset()
    model_cfg = cfg.model_config(vocab_size=65)
    net = build_model(model_cfg, seed=0)
    attn = apply_recompute(net, cfg.recompute, cfg.attention)
    engine = DDPBackend(cfg, net, attn, Dist())  # compiles the layers itself when cfg.compile (inductor)
    if compiled and backend != "inductor":  # smoke: the same per-layer compile with a cheap backend
        compile_layers(net, backend)
    g = torch.Generator().manual_seed(0)
    times, losses = [], []
    for _ in range(steps):
        batch = torch.randint(0, 65, (micro, seq + 1), generator=g)
        t0 = time.perf_counter()
        result = engine.train_step([batch], 1e-3)
        times.append(time.perf_counter() - t0)
        losses.append(result.loss)
    steady = sorted(times[WARMUP:])[len(times[WARMUP:]) // 2]  # median of the steady steps
    return {
        "tokens_per_s": micro * seq / steady,
        "first_step_s": times[0],
        "compile_s": times[0] - steady if compiled else 0.0,
        "losses": losses,
        "params": model_cfg.num_parameters(),
    }


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = summary["best"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{m}\n{p}" for m in best for p in best[m]]
    for i, mode in enumerate(("eager", "compiled")):
        ys = [best[m][p][mode]["tokens_per_s"] for m in best for p in best[m]]
        axes[0].bar([j + 0.4 * (i - 0.5) for j in range(len(ys))], ys, width=0.4, label=mode)
    axes[0].set_xticks(range(len(labels)), labels)
    axes[0].set_ylabel("tokens/s (one thread)")
    axes[0].set_title("plain training step, best round")
    axes[0].legend()
    times = [summary["compile_s"][m][p] for m in best for p in best[m]]
    axes[1].bar(
        [j - 0.2 for j in range(len(times))], [t["cold"] for t in times], width=0.4, label="cold cache (round 1)"
    )
    warm = [t["warm"] or 0.0 for t in times]
    axes[1].bar([j + 0.2 for j in range(len(times))], warm, width=0.4, label="warm cache (best later round)")
    axes[1].set_xticks(range(len(labels)), labels)
    axes[1].set_ylabel("compile time (s)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--models", nargs="+", default=["demo", "wide"], choices=list(MODELS))
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    backend, seq, micro = "inductor", SEQ, MICRO
    if args.smoke:
        args.rounds, args.steps, args.models, args.precisions = 1, WARMUP + 2, ["tiny"], ["fp32"]
        backend, seq, micro = "aot_eager", 32, 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="train_compile_")) if args.smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_cache_")  # round 1 is cold
    rows: list[dict] = []
    for r in range(args.rounds):
        for model in args.models:
            for precision in args.precisions:
                for compiled in (False, True):
                    rec = run(model, precision, compiled, args.steps, backend, seq, micro)
                    rows.append({"round": r, "model": model, "precision": precision, "compiled": compiled, **rec})
                    print(
                        f"round {r} {model} {precision} {'compiled' if compiled else 'eager'}: "
                        f"{rec['tokens_per_s']:.0f} tok/s, first step {rec['first_step_s']:.1f}s",
                        flush=True,
                    )
    best: dict = {}
    cold: dict = {}
    for model in args.models:
        best[model], cold[model] = {}, {}
        for precision in args.precisions:
            mine = [x for x in rows if x["model"] == model and x["precision"] == precision]
            best[model][precision] = {
                mode: max((x for x in mine if x["compiled"] == c), key=lambda x: x["tokens_per_s"])
                for mode, c in (("eager", False), ("compiled", True))
            }
            compiles = [x["compile_s"] for x in mine if x["compiled"]]
            cold[model][precision] = {"cold": compiles[0], "warm": min(compiles[1:]) if len(compiles) > 1 else None}
    summary = {
        "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?"),
        "load_avg_at_start": os.getloadavg(),
        "torch": torch.__version__,
        "compile_backend": backend,
        "seq_len": seq,
        "micro_batch": micro,
        "steps": args.steps,
        "warmup_steps_excluded": WARMUP,
        "threads": 1,
        "best": best,
        "compile_s": cold,
        "rounds_raw": rows,
    }
    (out / "train_compile.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, out / "train_compile.png")
    print("\n| model | precision | eager tok/s | compiled tok/s | speed-up | compile s (cold / warm) |")
    print("|---|---|---|---|---|---|")
    for model in best:
        for precision, b in best[model].items():
            e, c = b["eager"]["tokens_per_s"], b["compiled"]["tokens_per_s"]
            t = cold[model][precision]
            warm = "-" if t["warm"] is None else f"{t['warm']:.1f}"
            print(f"| {model} | {precision} | {e:,.0f} | {c:,.0f} | {c / e:.2f}x | {t['cold']:.1f} / {warm} |")
    print(f"wrote {out / 'train_compile.json'}")


if __name__ == "__main__":
    main()
