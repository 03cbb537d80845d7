"""bf16 linear layers on CPU: torch's F.linear (oneDNN, reordering the plain weight every call)
against a oneDNN weight reordered once (kernels/linear_cpu.py) and Baton's own GEMM over its packed
panels (kernels/csrc/gemm_cpu.cpp, where this CPU has AVX-512 / AVX-512 BF16), with fp32 F.linear,
fp32 packed by MKL or oneDNN (whichever the CPU takes without Baton's GEMM) and fp32 on Baton's
GEMM beside them,
at the 110M serving model's shapes (8 layers of qkv / o / gate_up / down plus the LM head, so the
weights do not sit in L2), M = 1..2048 rows; then whole decode steps of that model through the
model runner, packed and plain, at batch 1 and 8, with a torch-profiler split of one step.
Where oneDNN has no bf16 (e.g. AMD Zen 2), "bf16 packed" is the weight widened to fp32 and
packed by MKL (kernels/linear_cpu.py's bf16_path).

Sides alternate within each round and every side keeps its best, so all see the same load.
`--clock thread` times one torch thread by its own CPU time: on a machine shared with other work
that is steadier than wall time (other processes' time slices are not counted; cache contention is).

Usage: python benchmarks/linear_cpu.py [--clock wall|thread] [--rounds 7] [--smoke] [--out DIR]
(writes DIR/linear_cpu.{json,png}, default benchmarks/results)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.kernels.cpu_extension import cpu_kernels
from baton.kernels.linear_cpu import pack_weight, packed_linear
from baton.serve.core.sequence import Sequence
from baton.serve.runner.model_runner import ModelRunner
from baton.serve.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 4, "vocab_size": 8192}  # fmt: skip
TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip


def shapes(m: dict) -> list[tuple[int, int]]:
    """(K, N) of one decoder layer's fused projections."""
    h, i, d = m["hidden_size"], m["intermediate_size"], m["hidden_size"] // m["num_attention_heads"]
    return [(h, h + 2 * m["num_key_value_heads"] * d), (h, h), (h, 2 * i), (i, h)]


def best_of(fns: dict, rounds: int, clock) -> dict[str, float]:
    for f in fns.values():
        f()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for k, f in fns.items():
            t = clock()
            f()
            best[k] = min(best[k], clock() - t)
    return best


@torch.inference_mode()
def linears(m: dict, rows: list[int], rounds: int, clock) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    sh = shapes(m) * m["num_hidden_layers"] + [(m["hidden_size"], m["vocab_size"])]
    w32 = [torch.randn(n, k, generator=g) / k**0.5 for k, n in sh]
    w16 = [w.bfloat16() for w in w32]
    ck = cpu_kernels()  # Baton's GEMM is used once a server loaded the kernels: load them here
    sides = {
        "fp32": (w32, [pack_weight(w, gemm=False) for w in w32]),
        "bf16": (w16, [pack_weight(w, gemm=False) for w in w16]),
    }
    for name, ws in (("fp32", w32), ("bf16", w16)):
        if ck is not None and ck.gemm_available(ws[0].dtype):
            sides[f"{name} baton"] = (ws, [pack_weight(w, gemm=True) for w in ws])
    out = []
    for M in rows:
        x32 = {k: torch.randn(M, k, generator=g) for k, _ in sh}
        xs = {torch.float32: x32, torch.bfloat16: {k: x.bfloat16() for k, x in x32.items()}}
        fns = {}
        for name, (ws, packed) in sides.items():
            x = xs[ws[0].dtype]
            if " " not in name:
                fns[f"{name} F.linear"] = lambda x=x, ws=ws: [F.linear(x[w.shape[1]], w) for w in ws]
                name = f"{name} packed"
            fns[name] = lambda x=x, ws=ws, packed=packed: [packed_linear(x[w.shape[1]], p) for w, p in zip(ws, packed)]
        t = best_of(fns, rounds, clock)
        out.append({"rows": M, "ms": {k: v * 1e3 for k, v in t.items()}})
        print(f"M={M:5d} " + "  ".join(f"{k} {v * 1e3:8.2f} ms" for k, v in t.items()), flush=True)
    return out


def decode_runner(m: dict, packed: bool, batch: int) -> tuple[ModelRunner, list[Sequence]]:
    os.environ["BATON_CPU_PACKED_LINEAR"] = "1" if packed else "0"
    model = build_model(ModelConfig(max_position_embeddings=512, **m), seed=0).to(torch.bfloat16)
    runner = ModelRunner(model, num_blocks=batch * 8, block_size=16)
    os.environ.pop("BATON_CPU_PACKED_LINEAR")
    seqs = []
    for i in range(batch):
        s = Sequence(i, str(i), 0, [(7 * i + j) % m["vocab_size"] for j in range(100)], SamplingParams())
        s.block_table = list(range(i * 8, i * 8 + 8))
        runner.execute([(s, 100)])
        s.num_computed_tokens = 100
        s.token_ids.append(1)
        seqs.append(s)
    return runner, seqs


def decode_steps(m: dict, batches: list[int], rounds: int, clock) -> list[dict]:
    """One decode step (forward + LM head) of `batch` sequences at context 100, packed vs plain;
    the sequences do not advance, so every timed step is the same step."""
    out = []
    for b in batches:
        sides = {name: decode_runner(m, name == "packed", b) for name in ("plain", "packed")}
        fns = {k: (lambda r=r, s=s: r.execute([(q, 1) for q in s])) for k, (r, s) in sides.items()}
        t = best_of(fns, rounds, clock)
        prof = {}
        for name, f in fns.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                f()
            ev = p.key_averages()
            total = sum(e.self_cpu_time_total for e in ev)
            lin = sum(e.self_cpu_time_total for e in ev if "linear" in e.key or "mm" in e.key or "matmul" in e.key)
            prof[name] = {"linear_share": lin / total if total else 0.0}
        out.append({"batch": b, "ms": {k: v * 1e3 for k, v in t.items()}, "profile": prof})
        print(f"decode batch {b}: " + "  ".join(f"{k} {v * 1e3:.2f} ms (linears {prof[k]['linear_share']:.0%})" for k, v in t.items()), flush=True)  # fmt: skip
    return out


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [c["rows"] for c in r["linears"]]
    for k in r["linears"][0]["ms"]:
        ax.plot(rows, [c["ms"][k] for c in r["linears"]], marker="o", label=k)
    ax.set(xscale="log", yscale="log", xlabel="rows M", ylabel="ms for all the model's linears")
    ax.set_title(f"CPU linears of the {r['model']} model ({r['clock']} clock, {r['threads']} threads)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 64, 256, 2048])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--smoke", action="store_true", help="tiny model, few rows, 2 rounds")
    ap.add_argument("--note", default="shared machine, under load")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.clock == "thread":
        torch.set_num_threads(1)  # the clock sees only this thread
    m = TINY if args.smoke else MODEL
    rows, batches, rounds = ([1, 4], [1, 2], 2) if args.smoke else (args.rows, args.batches, args.rounds)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    r = {"model": "tiny" if args.smoke else "110M", "clock": args.clock, "threads": torch.get_num_threads()}
    r["note"] = args.note
    r["linears"] = linears(m, rows, rounds, clock)
    r["decode"] = decode_steps(m, batches, rounds, clock)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linear_cpu.json").write_text(json.dumps(r, indent=1) + "\n")
    plot(r, args.out / "linear_cpu.png")


if __name__ == "__main__":
    main()
