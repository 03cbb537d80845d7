"""gRPC server overhead: the same closed-loop load through `baton serve` and straight into the engine.

For each concurrency level, C clients each send their next request as soon as the previous one
finishes. The same requests run (a) in this process against AsyncLLMEngine, the engine with no
server, and (b) against a `baton serve` subprocess over gRPC on loopback; the difference is the
server's cost. (c) LLM.generate on every request at once is the offline throughput ceiling.
TTFT is send -> first token, ITL the gap between streamed tokens, both seen by the client.
Greedy outputs over gRPC are checked against the offline engine's.

Usage: python benchmarks/serve_grpc.py [--quick] [--model CKPT]
(writes benchmarks/results/serve_grpc.{json,png}; default model: random weights, built here)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from contextlib import aclosing
from pathlib import Path

from baton.common.checkpoint import read_config, save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.serve.async_engine import AsyncLLMEngine
from baton.serve.client import AsyncBatonClient
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.llm import LLM
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from serve_engine import MODEL, RESULTS  # noqa: E402 - the same model as the engine benchmark (script dir is on sys.path)

KV_MB, MAX_SEQS = 256, 64


def engine_config() -> EngineConfig:
    return EngineConfig(kv_cache_bytes=KV_MB * 2**20, scheduler=SchedulerConfig(max_num_seqs=MAX_SEQS))


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(16, 128))] for _ in range(n)]


def in_thread(fn, *args):
    """Run fn on a worker thread, as AsyncLLMEngine (in-process and in the server) runs the engine:
    torch's CPU thread pool behaves differently on the main thread, which would skew the comparison."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


async def closed_loop(prompts: list[list[int]], concurrency: int, stream_one) -> dict:
    """Run every prompt with `concurrency` workers; stream_one(prompt) yields token lists."""
    todo = list(enumerate(prompts))
    ttft, itl, outputs = [], [], {}

    async def worker():
        while todo:
            i, prompt = todo.pop(0)
            t0 = last = time.perf_counter()
            ids = []
            async for new in stream_one(prompt):
                now = time.perf_counter()
                if new:
                    (itl if ids else ttft).append(now - last)
                    last = now
                    ids += new
            outputs[i] = ids

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in outputs.values())
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_per_s": tokens / wall,
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p99_ms": pct(ttft, 0.99),
        "itl_p50_ms": pct(itl, 0.5),
        "itl_p99_ms": pct(itl, 0.99),
        "outputs": [outputs[i] for i in range(len(prompts))],
        "ttft": ttft,
        "itl": itl,
    }


def engine_runner(ckpt: Path, params: SamplingParams):
    """(run(prompts, concurrency), shutdown) for the in-process engine, kept across runs like the server."""
    engine = AsyncLLMEngine(LLMEngine.from_checkpoint(ckpt, engine_config()))
    ids = iter(range(10**9))

    async def one(prompt):
        async for out in engine.generate(prompt, params, f"b{next(ids)}"):
            yield out.outputs[0].delta_token_ids

    return (lambda prompts, c: asyncio.run(closed_loop(prompts, c, one))), engine.shutdown


def start_server(ckpt: Path, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "baton.common.cli",
            "serve",
            "--model",
            str(ckpt),
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--kv-cache-mb",
            str(KV_MB),
            "--max-num-seqs",
            str(MAX_SEQS),
            "--max-concurrent",
            str(MAX_SEQS),
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while not (m := re.search(r"ready: .* grpc=([\d.]+:\d+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(log.read_text())
        time.sleep(0.1)
    return proc, m[1]


def run_grpc(target: str, prompts, concurrency: int, max_tokens: int) -> dict:
    async def main():
        client = AsyncBatonClient(target, timeout=600)

        async def one(prompt):
            async with aclosing(client.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)) as s:
                async for msg in s:
                    yield list(msg.completions[0].token_ids)

        try:
            return await closed_loop(prompts, concurrency, one)
        finally:
            await client.close()

    return asyncio.run(main())


PATHS = (("engine", "engine, no server", "C0"), ("grpc", "baton serve (gRPC)", "C1"))


def plot(
    results: dict,
    path: Path,
    paths=PATHS,
    title: str = "gRPC server vs engine, same closed-loop load (CPU, 2 cores)",
) -> None:
    """Throughput, TTFT and ITL against concurrency, one line per (key, label, colour) of `paths`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = results["concurrency"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, label, color in paths:
        rows = [results["runs"][str(c)][key] for c in levels]
        axes[0].plot(levels, [r["tok_per_s"] for r in rows], "o-", color=color, label=label)
        for ax, metric in ((axes[1], "ttft"), (axes[2], "itl")):
            ax.plot(levels, [r[f"{metric}_p50_ms"] for r in rows], "o-", color=color, label=f"{label} p50")
            ax.plot(levels, [r[f"{metric}_p99_ms"] for r in rows], "x--", color=color, label=f"{label} p99")
    axes[0].axhline(results["offline_tok_per_s"], color="gray", ls=":", label="LLM.generate, all submitted at once")
    for ax, title, unit in zip(
        axes, ("throughput", "time to first token", "inter-token latency"), ("output tokens/s", "ms", "ms")
    ):
        ax.set(title=title, xlabel="concurrent clients", ylabel=unit, xscale="log")
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: random weights, built here)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the fastest is kept (shared machine)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 16 requests of 16 tokens, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.concurrency, args.repeats = 16, 16, [1, 8], 1
    tmp = Path(tempfile.mkdtemp(prefix="baton-bench-"))
    ckpt = args.model
    if ckpt is None:
        ckpt = save_model(tmp / "model", build_model(ModelConfig(**MODEL), seed=0))
    vocab = read_config(ckpt).vocab_size
    prompts = workload(args.requests, vocab)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    llm = LLM(ckpt, engine_config())
    in_thread(llm.generate, prompts, params)  # warm-up: CPU kernels are slow the first time they meet a shape
    offline_s = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        reference = [o.outputs[0].token_ids for o in in_thread(llm.generate, prompts, params)]
        offline_s = min(offline_s, time.perf_counter() - t0)
    del llm
    results = {
        "model": str(args.model) if args.model else MODEL,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "concurrency": args.concurrency,
        "offline_tok_per_s": sum(map(len, reference)) / offline_s,
        "runs": {},
    }
    run_engine, stop_engine = engine_runner(ckpt, params)
    proc, target = start_server(ckpt, tmp / "serve.log")
    try:
        run_engine(prompts, max(args.concurrency))  # the same warm-up for both paths
        run_grpc(target, prompts, max(args.concurrency), args.max_tokens)
        for c in args.concurrency:
            engine = max((run_engine(prompts, c) for _ in range(args.repeats)), key=lambda r: r["tok_per_s"])
            grpc_run = max(
                (run_grpc(target, prompts, c, args.max_tokens) for _ in range(args.repeats)),
                key=lambda r: r["tok_per_s"],
            )
            mismatches = sum(a != b for a, b in zip(grpc_run["outputs"], reference))
            results["runs"][str(c)] = {
                "engine": {k: v for k, v in engine.items() if k not in ("outputs", "ttft", "itl")},
                "grpc": {k: v for k, v in grpc_run.items() if k not in ("outputs", "ttft", "itl")},
                "grpc_outputs_differing_from_offline": mismatches,
            }
    finally:
        stop_engine()
        proc.terminate()
        proc.wait(60)

    print(
        f"\n{args.requests} requests, prompts 16-128 tokens, {args.max_tokens} output tokens each; "
        f"offline LLM.generate: {results['offline_tok_per_s']:.0f} tok/s"
    )
    head = f"{'clients':>7} {'path':<7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
    print(head + "   (ms)\n" + "-" * len(head))
    for c in args.concurrency:
        run = results["runs"][str(c)]
        for key in ("engine", "grpc"):
            r = run[key]
            print(
                f"{c:>7} {key:<7} {r['tok_per_s']:>8.0f} {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} "
                f"{r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>8.2f}"
            )
        ratio = run["grpc"]["tok_per_s"] / run["engine"]["tok_per_s"]
        print(
            f"{'':>7} gRPC/engine throughput {ratio:.2f}; outputs differing from offline: "
            f"{run['grpc_outputs_differing_from_offline']}"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve_grpc.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "serve_grpc.png")
    print(f"wrote {RESULTS / 'serve_grpc.json'} and {RESULTS / 'serve_grpc.png'}")


if __name__ == "__main__":
    main()
