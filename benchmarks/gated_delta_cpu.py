"""The gated delta rule on CPU: which path serves prefill and which serves decode, measured.

Shapes are Qwen3.5's linear-attention layer (16 key and 32 value heads of 128) scaled to a 2-core CPU:
Hk 8, Hv 16, Dk = Dv = 128 (a 1 MiB float32 state per sequence and layer). Sections:
- prefill: one sequence of T tokens through the chunked torch form (chunk 32/64/128), the float32
  token loop, and transformers' torch_chunk_gated_delta_rule as an outside baseline. The shortest T
  where the chunked form wins is where kernels/gated_delta.py's CPU_RECURRENT_MAX_LEN should sit.
- decode: one token for each of N sequences: decode_step over a slot pool (gather, step, scatter:
  how the server holds states), the token loop on a batch of states it owns, the chunked form at T=1.
- flat: decode_step with states reached after 1k and after 16k prefilled tokens: the same cost.

Usage: python benchmarks/gated_delta_cpu.py [--clock thread|wall] [--rounds 5] [--smoke] [--out DIR]
(writes DIR/gated_delta_cpu.{json,png}; by default benchmarks/results). The thread clock runs torch on
one thread and counts only its CPU time, so other load on the machine barely moves the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from baton.kernels import gated_delta as gd
from baton.serve.runner.model_runner import keep_freed_memory

RESULTS = Path(__file__).resolve().parent / "results"
FULL = dict(hk=8, hv=16, d=128, lengths=[1, 2, 4, 8, 16, 64, 256, 1024, 4096], batches=[1, 2, 4, 8, 16, 32],
            contexts=[1024, 16384], flat_batches=[1, 8])  # fmt: skip
SMOKE = dict(hk=1, hv=2, d=16, lengths=[1, 4, 64], batches=[1, 4], contexts=[64, 256], flat_batches=[1])


def best_ms(fn, rounds: int, clock) -> float:
    fn()  # warm-up (allocator, first-call paths)
    best = float("inf")
    for _ in range(rounds):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best * 1e3


def tokens(b: int, length: int, s: dict, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, length, s["hk"], s["d"], generator=gen) for _ in range(2))
    v = torch.randn(b, length, s["hv"], s["d"], generator=gen)
    g = -0.5 * torch.rand(b, length, s["hv"], generator=gen)
    return q, k, v, g, torch.rand(b, length, s["hv"], generator=gen)


def prefill(s: dict, rounds: int, clock, hf) -> list[dict]:
    rows = []
    for length in s["lengths"]:
        x = tokens(1, length, s)
        paths = {
            f"chunked (chunk {c})": (lambda c=c: gd.gated_delta_rule_torch(*x, chunk_size=c, **NORM))
            for c in (32, 64, 128)
        }
        paths["token loop"] = lambda: gd.gated_delta_rule_recurrent(*x, **NORM)
        if hf is not None:
            paths["transformers chunked"] = lambda: hf(*x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        row = {
            "tokens": length,
            "ms": {name: best_ms(fn, rounds if length < 4096 else 1, clock) for name, fn in paths.items()},
        }
        rows.append(row)
        print(f"prefill {length:>6} tokens: " + "  ".join(f"{n} {ms:8.2f}" for n, ms in row["ms"].items()), flush=True)
    return rows


def decode(s: dict, rounds: int, clock) -> list[dict]:
    rows = []
    for n in s["batches"]:
        q, k, v, g, beta = (t[:, 0] for t in tokens(n, 1, s))
        pool = torch.randn(2 * n + 1, s["hv"], s["d"], s["d"]) * 0.1
        slots = torch.randperm(2 * n + 1, generator=torch.Generator().manual_seed(n))[:n]  # scattered, as a busy pool's
        states = pool[slots].clone()
        one = lambda t: t[:, None]  # noqa: E731 - one token per sequence as a [N, 1, ...] batch
        paths = {
            "decode_step (slot pool)": lambda: gd.decode_step(q, k, v, g, beta, pool, slots, **NORM),
            "token loop (own states)": lambda: gd.gated_delta_rule_recurrent(
                *map(one, (q, k, v, g, beta)), states, **NORM
            ),
            "chunked, T=1 (own states)": lambda: gd.gated_delta_rule_torch(
                *map(one, (q, k, v, g, beta)), states, **NORM
            ),
        }
        row = {"batch": n, "ms": {name: best_ms(fn, rounds, clock) for name, fn in paths.items()}}
        # bytes the step must move at least: read and write every state once
        row["state_gb_per_s"] = 2 * states.numel() * 4 / row["ms"]["decode_step (slot pool)"] / 1e6
        rows.append(row)
        print(f"decode batch {n:>3}: " + "  ".join(f"{k} {ms:7.3f}" for k, ms in row["ms"].items())
              + f"  ({row['state_gb_per_s']:.1f} GB/s of state)", flush=True)  # fmt: skip
    return rows


def flat(s: dict, rounds: int, clock) -> list[dict]:
    """States reached by really prefilling 1k and 16k tokens (chunked form), then decode steps from
    them: the contexts' rounds interleaved (load on the machine hits both alike), each timed step on a
    fresh copy of the states made outside the clock."""
    states = {c: gd.gated_delta_rule_torch(*tokens(1, c, s, seed=c), **NORM)[1] for c in s["contexts"]}
    best = {(c, n): float("inf") for c in s["contexts"] for n in s["flat_batches"]}
    for round_ in range(rounds + 1):  # round 0 warms up
        for context, n in best:
            q, k, v, g, beta = (t[:, 0] for t in tokens(n, 1, s, seed=1))
            pool = states[context].expand(n, *states[context].shape[1:]).contiguous()
            t = clock()
            gd.decode_step(q, k, v, g, beta, pool, torch.arange(n), **NORM)
            if round_:
                best[context, n] = min(best[context, n], (clock() - t) * 1e3)
    rows = [{"context": c, "batch": n, "ms_per_step": ms} for (c, n), ms in best.items()]
    for r in rows:
        print(f"decode after {r['context']:>6} tokens, batch {r['batch']:>2}: {r['ms_per_step']:7.3f} ms/step")
    return rows


NORM = dict(use_qk_l2norm_in_kernel=True)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    xs = [row["tokens"] for row in r["prefill"]]
    for name in r["prefill"][0]["ms"]:
        a.plot(xs, [row["ms"][name] / row["tokens"] * 1e3 for row in r["prefill"]], marker="o", label=name)
    a.set(xscale="log", yscale="log", xlabel="prefill tokens T", ylabel="us per token", title="prefill")
    xs = [row["batch"] for row in r["decode"]]
    for name in r["decode"][0]["ms"]:
        b.plot(xs, [row["ms"][name] for row in r["decode"]], marker="o", label=name)
    b.set(xscale="log", yscale="log", xlabel="sequences per decode step", ylabel="ms per step", title="decode")
    for n in sorted({row["batch"] for row in r["flat"]}):
        rows = [row for row in r["flat"] if row["batch"] == n]
        c.plot([row["context"] for row in rows], [row["ms_per_step"] for row in rows], marker="o", label=f"batch {n}")
    c.set(xscale="log", xlabel="tokens before the step", ylabel="ms per decode step", title="decode vs context")
    c.set_ylim(bottom=0)
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = r["shape"]
    fig.suptitle(
        f"Gated delta rule on CPU: Hk {s['hk']}, Hv {s['hv']}, Dk = Dv = {s['d']} ({r['clock']} clock, "
        f"{r['threads']} thread(s)); CPU_RECURRENT_MAX_LEN measured {r['recurrent_max_len_measured']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--threads", type=int, default=2, help="torch threads with the wall clock (thread clock: 1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 1 round (the test's mode)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' baseline (saves its import)")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    s, rounds = (SMOKE, 1) if args.smoke else (FULL, args.rounds)
    threads = 1 if args.clock == "thread" else args.threads
    torch.set_num_threads(threads)
    keep_freed_memory()  # as the serving runner does: else every call page-faults its large buffers back in
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    hf = None
    if not args.no_hf:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as hf
    with torch.no_grad():
        result = {
            "shape": {k: s[k] for k in ("hk", "hv", "d")},
            "clock": args.clock,
            "threads": threads,
            "rounds": rounds,
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "note": args.note,
            "prefill": prefill(s, rounds, clock, hf),
            "decode": decode(s, rounds, clock),
            "flat": flat(s, rounds, clock),
        }
    # the dispatch threshold: the longest T below the first length where a chunked form beats the loop
    wins = []
    for row in result["prefill"]:
        chunked = min(ms for name, ms in row["ms"].items() if name.startswith("chunked "))
        if chunked < row["ms"]["token loop"]:
            wins.append(row["tokens"])
    first = min(wins) if wins else None
    result["recurrent_max_len_measured"] = max([t for t in s["lengths"] if first is None or t < first], default=0)
    result["recurrent_max_len_in_module"] = gd.CPU_RECURRENT_MAX_LEN
    print(f"the token loop wins up to T = {result['recurrent_max_len_measured']} (module: {gd.CPU_RECURRENT_MAX_LEN})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gated_delta_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "gated_delta_cpu.png")
    print(f"wrote {args.out / 'gated_delta_cpu.json'} and {args.out / 'gated_delta_cpu.png'}")


if __name__ == "__main__":
    main()
