"""OpenMP wait policy and thread count for Baton's CPU engine, quiet and beside a competing process.

Why: on a 2-core machine Baton's two-thread decode collapsed (~15x slower) whenever one other
process competed for the cores, where vLLM's slowed ~2x. A decode step is hundreds of small
parallel regions; libgomp's threads spin at every barrier (GOMP_SPINCOUNT, 300k by default), so a
thread whose partner was descheduled burns its own time slice waiting, region after region. This
measures decode tokens/s for each OpenMP setting (each in a fresh process: libgomp reads its
environment once, at load) with 0 and 1 busy competitor processes, interleaved over rounds. "auto"
is Baton's default (serve/openmp.py): sleep when the machine is already busy at start-up.

Usage: python benchmarks/serve_threads.py [--rounds 2] [--alone-realtime] [--smoke]   (writes results/serve_threads.{json,png})
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CORES = os.cpu_count() or 1
SPIN = {"OMP_NUM_THREADS": str(CORES), "BATON_OMP_WAIT_POLICY": "spin"}  # libgomp's own default
SETTINGS = {  # name -> environment for the measured process
    "default": SPIN,
    "spin 10k": {**SPIN, "GOMP_SPINCOUNT": "10000"},
    "spin 30k": {**SPIN, "GOMP_SPINCOUNT": "30000"},
    "spin 100k": {**SPIN, "GOMP_SPINCOUNT": "100000"},
    "passive": {**SPIN, "OMP_WAIT_POLICY": "PASSIVE"},
    "bound": {**SPIN, "GOMP_CPU_AFFINITY": " ".join(map(str, range(CORES)))},
    "1 thread": {**SPIN, "OMP_NUM_THREADS": "1"},
    "auto": {"OMP_NUM_THREADS": str(CORES)},  # what `import baton.serve` chooses (serve/openmp.py)
}


def measure(model_dir: str, batches: list[int], tokens: int) -> dict:
    """Decode tokens/s at each batch size: (generate 1 + n) - (generate 1), best of two; also the
    thread count torch runs with and the greedy tokens (a setting must not change them)."""
    import random

    from baton.serve import openmp  # first: it picks the wait policy before torch loads libgomp

    # isort: split
    import torch
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams

    llm = LLM(model_dir)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    out, made = {}, []
    for b in batches:
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(16)]} for _ in range(b)]
        short, long = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 1 + tokens))
        made += [list(o.outputs[0].token_ids) for o in llm.generate(prompts, long)]  # also the warm-up
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            llm.generate(prompts, short)
            t1 = time.perf_counter()
            llm.generate(prompts, long)
            best = min(best, (time.perf_counter() - t1) - (t1 - t0))
        out[str(b)] = b * tokens / best
    return {"tok_s": out, "threads": torch.get_num_threads(), "tokens": made, "openmp": openmp.decision}


def make_model(directory: Path, smoke: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    size = (
        {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2, "num_attention_heads": 4}
        if smoke
        else {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6, "num_attention_heads": 8}
    )
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, num_key_value_heads=2, max_position_embeddings=1024, **size)
    LlamaForCausalLM(config).save_pretrained(directory)


def realtime() -> None:
    """SCHED_FIFO for the measured process (root): it runs ahead of every normal process, so on a
    machine others share it sees the cores as its own - "alone" without pausing anybody for long."""
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))


def run_one(model_dir: Path, env: dict[str, str], job: argparse.Namespace, competitors: int) -> dict:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(competitors)]
    try:
        batches = ",".join(map(str, job.batches))
        cmd = [sys.executable, __file__, "--measure", str(model_dir), batches, str(job.tokens)]
        alone = job.alone_realtime and competitors == 0
        inherited = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        proc = subprocess.run(
            cmd,
            env={**inherited, **env},
            capture_output=True,
            text=True,
            check=True,
            preexec_fn=realtime if alone else None,
        )
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(report["results"])
    fig, axes = plt.subplots(1, len(report["batches"]), figsize=(5 * len(report["batches"]), 4), squeeze=False)
    for ax, b in zip(axes[0], report["batches"]):
        for i, c in enumerate(report["results"][cases[0]]):
            vals = [report["results"][s][c][str(b)] for s in cases]
            ax.bar([x + 0.4 * i for x in range(len(cases))], vals, width=0.4, label=f"{c} competitor(s)")
        ax.set_xticks([x + 0.2 for x in range(len(cases))], cases, rotation=20)
        ax.set_title(f"decode batch {b}")
        ax.set_ylabel("tokens/s (best round)")
        ax.legend()
    fig.suptitle(f"OpenMP settings, {CORES} cores ({report['note']})")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--competitors", nargs="+", type=int, default=[0, 1], help="busy processes beside it")
    ap.add_argument("--smoke", action="store_true", help="tiny model, one round, 4 tokens, batches 1 and 4")
    ap.add_argument(
        "--alone-realtime",
        action="store_true",
        help="run the 0-competitor cases under SCHED_FIFO (root): alone on the cores even on a shared machine",
    )
    ap.add_argument("--note", default="shared machine")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        model_dir, batches, tokens = args.measure
        return print(json.dumps(measure(model_dir, [int(b) for b in batches.split(",")], int(tokens))))
    if args.smoke:
        args.rounds, args.tokens, args.batches = 1, 4, [1, 4]
    results = {s: {str(c): {} for c in args.competitors} for s in args.settings}
    checks = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), args.smoke)
        for r in range(args.rounds):
            for competitors in args.competitors:
                for name in args.settings:
                    got = run_one(Path(tmp), SETTINGS[name], args, competitors)
                    best = results[name][str(competitors)]
                    for b, v in got["tok_s"].items():
                        best[b] = max(best.get(b, 0.0), v)
                    checks.setdefault(name, {"threads": got["threads"], "tokens": got["tokens"]})
                    checks[name].setdefault("openmp", {})[str(competitors)] = got["openmp"]
                    rates = ", ".join(f"b{b} {v:.0f}" for b, v in got["tok_s"].items())
                    print(f"round {r + 1}: {name:>9}, {competitors} competitor(s): {rates} tok/s", flush=True)
    report = {"cores": CORES, "batches": args.batches, "tokens": args.tokens, "rounds": args.rounds}
    report["alone_realtime"] = args.alone_realtime
    first = next(iter(checks.values()))["tokens"]
    report.update(note=args.note, load_average=os.getloadavg(), results=results)
    report["threads"] = {name: c["threads"] for name, c in checks.items()}
    report["openmp"] = {name: c["openmp"] for name, c in checks.items()}
    report["settings_changing_greedy_tokens"] = [name for name, c in checks.items() if c["tokens"] != first]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "serve_threads_smoke" if args.smoke else "serve_threads"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / f"{stem}.png")
    cols = [(b, str(c)) for b in args.batches for c in args.competitors]
    print("| setting | " + " | ".join(f"b{b}, {c} busy" for b, c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, res in results.items():
        cells = " | ".join(f"{res[c][str(b)]:.0f}" for b, c in cols)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
