"""Distributed serving on one machine: T=1 vs tensor-parallel T=2 vs pipeline-parallel P=2, same run.

A random-weight ~110M Llama (hidden 1024, 8 layers, GQA 16/4 heads, vocab 32000, tied embeddings,
fp32) serves the engine benchmark's ShareGPT-like mixed workload (benchmarks/serve_engine.py's
`workload`, all requests at t=0, greedy, ignore_eos) through `LLM(..., tensor_parallel_size=,
pipeline_parallel_size=)`. T=1 runs in this process with every core; a sharded layout runs one
process per rank with cores // ranks threads each (what start_distributed gives them), so every
layout has the same cores; "T=1/1t" (one process at one thread) is a control that separates what
sharding costs from what threads do. Layouts are interleaved, `--repeats` runs each, medians and
best runs reported, because this machine is shared and its speed drifts by up to 2x over minutes.

Per layout: output tokens/s, TTFT and TPOT (mean/p50/p90), a steady decode round at batch 64
(every sequence one token further), the driver's control-plane time per step
(DistributedRunner.control_s / steps: handing each step's command to the workers), per-rank weight
bytes and per-rank KV bytes (block bytes x blocks; every layout gets the same number of KV blocks,
so they schedule alike). Also the pickled size and (un)pickling time of the control-plane message
for a batch of 64 decodes. `--profile` adds torch.profiler on the driver over the batch-64 decode
(first round), by op category. Each run records the load average: rerun on a quiet machine.

Usage: python benchmarks/serve_parallel.py [--smoke] [--profile] [--out DIR]
       (writes OUT/serve_parallel.{json,png}; OUT defaults to benchmarks/results)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.kernels.linear_cpu import GEMM_PROFILER_NAME, PROFILER_NAME
from baton.serve import LLM, SamplingParams
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig
from baton.serve.parallel.loader import weight_bytes
from baton.serve.runner.model_runner import kv_block_bytes
from baton.serve.runner.step_plan import StepPlan, TableSender, plan_chunks
from baton.serve.scheduling.scheduler import SchedulerConfig
from serve_engine import MODEL, RESULTS, pct, run_engine, workload  # the engine benchmark's (script dir is on sys.path)

MODEL_110M = {
    **MODEL,
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2304,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "tie_word_embeddings": True,
}
MODEL_SMOKE = {
    **MODEL,
    "tie_word_embeddings": True,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
}
# (tensor, pipeline, threads per rank; None: cores // ranks). "T=1/1t" is a control: one process at
# one thread, as each sharded rank runs, which separates what sharding costs from what threads do.
LAYOUTS = {"T=1": (1, 1, None), "T=2": (2, 1, None), "P=2": (1, 2, None), "T=1/1t": (1, 1, 1)}
BLOCK_SIZE = 16
DECODE_BATCH = 64


def engine_config(num_blocks: int) -> EngineConfig:
    """vLLM's batch limits (as the engine benchmark); a fixed block count, so every layout schedules alike."""
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048)
    return EngineConfig(num_kv_blocks=num_blocks, block_size=BLOCK_SIZE, scheduler=sched)


def control(runner) -> tuple[float, int]:
    """(seconds the driver spent handing commands to the workers, steps run); (0, 0) in one process."""
    return getattr(runner, "control_s", 0.0), getattr(runner, "steps", 0)


def memory(runner) -> dict:
    """Per-rank weight and KV bytes, as every rank reported them at start-up."""
    stats = getattr(getattr(runner, "topo", None), "stats", None)
    if stats:
        weights, block = stats["weight_bytes"], stats["kv_block_bytes"]
    else:
        weights = [weight_bytes(runner.model)]
        block = [kv_block_bytes(runner.model, runner.block_size, runner.dtype)]
    return {"weight_bytes": list(weights), "kv_bytes": [b * runner.num_blocks for b in block]}


def decode_steps(llm: LLM, vocab: int, steps: int, profile: bool = False) -> dict:
    """A steady decode at batch DECODE_BATCH, timed once every sequence has its first token: ms per
    round (every sequence one token further: one step, or P steps when a pipeline keeps P batches
    in flight, each of about 1/P of the sequences), tokens/s, and the driver's torch profile when asked."""
    engine, rng, tag = llm.engine, random.Random(3), "p" if profile else "d"
    for i in range(DECODE_BATCH):
        prompt = [rng.randrange(vocab) for _ in range(16)]
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    started: set[str] = set()
    while len(started) < DECODE_BATCH:  # the prefills (and each sequence's first token)
        started |= {out.request_id for out in engine.step() if out.outputs[0].delta_token_ids}
    c0, s0 = control(engine.runner)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.start()
    n = tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(out.outputs[0].delta_token_ids) for out in engine.step())
        n += 1
    wall = time.perf_counter() - t0
    if prof:
        prof.stop()
    c1, s1 = control(engine.runner)
    out = {"round_ms": DECODE_BATCH * wall / tokens * 1e3, "tok_per_s": tokens / wall, "step_ms": wall / n * 1e3}
    out["steps"] = n
    if s1 > s0:
        out["control_ms_per_step"] = (c1 - c0) / (s1 - s0) * 1e3
    if prof:
        out["profile"] = summarize(prof, wall, n)
    return out


PACKED_GEMMS = (
    "mkldnn::_linear_pointwise",
    PROFILER_NAME,
    GEMM_PROFILER_NAME,
)  # linears packed at load (kernels/linear_cpu.py)
CATEGORIES = (  # first match wins; op names as torch.profiler reports them on CPU
    ("collectives", ("c10d", "gloo", "allreduce", "all_reduce", "all_gather", "broadcast", "send", "recv")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", *PACKED_GEMMS)),
    ("attention", ("paged", "attention", "sdpa", "softmax")),
)


def summarize(prof, wall: float, steps: int) -> dict:
    """Self CPU time per category per step, the top ops, and what no op covers (Python: the engine,
    the scheduler, building tensors from the plan)."""
    per = {name: 0.0 for name, _ in CATEGORIES} | {"other ops": 0.0}
    rows = []
    for ev in prof.key_averages():
        ms = ev.self_cpu_time_total / 1e3 / steps
        if ev.key.startswith("ProfilerStep") or ms <= 0:
            continue
        cat = next((n for n, keys in CATEGORIES if any(k in ev.key.lower() for k in keys)), "other ops")
        per[cat] += ms
        rows.append((ms, ev.key, ev.count // steps))
    rows.sort(reverse=True)
    step_ms = wall / steps * 1e3
    return {
        "step_ms": step_ms,
        "ms_per_step": per | {"outside ops (Python)": max(0.0, step_ms - sum(per.values()))},
        "top_ops": [{"op": k, "ms_per_step": ms, "calls_per_step": c} for ms, k, c in rows[:15]],
    }


def run_layout(ckpt: Path, name: str, reqs, num_blocks: int, vocab: int, decode_n: int, profile: bool) -> dict:
    tp, pp, threads = LAYOUTS[name]
    if tp * pp == 1:  # a sharded run set this process's threads to cores // ranks: give T=1 every core back
        torch.set_num_threads(threads or os.cpu_count() or 1)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    with LLM(ckpt, engine_config(num_blocks), tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        started = time.perf_counter() - t0
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        runner = llm.engine.runner
        c0, s0 = control(runner)
        wall, ttft, tpot, _ = run_engine(llm.engine, reqs)
        c1, s1 = control(runner)
        row = {
            "layout": name,
            "threads_per_rank": torch.get_num_threads(),
            "startup_s": started,
            "wall_s": wall,
            "out_tok_per_s": sum(o for _, o in reqs) / wall,
            "loadavg_1m": [load0, os.getloadavg()[0]],  # at its start and after its workload
            "ttft_s": stats(ttft),
            "tpot_s": stats(tpot),
            "decode": decode_steps(llm, vocab, decode_n),
            **memory(runner),
        }
        if s1 > s0:
            row["control_ms_per_step"] = (c1 - c0) / (s1 - s0) * 1e3
            row["steps"] = s1 - s0
        if profile:  # a second decode pass: the profiler's own cost stays out of the timed one
            row["profile"] = decode_steps(llm, vocab, decode_n, profile=True)["profile"]
    return row


def stats(xs: list[float]) -> dict:
    return {"mean": statistics.mean(xs), "p50": pct(xs, 0.5), "p90": pct(xs, 0.9)}


def plan_cost(reqs, repeats: int = 200) -> dict:
    """The control-plane message for a batch of 64 decodes, as the driver pickles it for the workers:
    bytes and (un)pickling time (µs). The whole StepPlan, and the wire step that travels instead
    (chunks; each block table as a delta against the one the workers hold): the first time a
    sequence is sent (its whole table) and in the steady state (the tables known)."""
    seqs = []
    for i, (prompt, out_len) in enumerate(reqs[:DECODE_BATCH]):
        s = Sequence(i, str(i), 0, list(prompt), SamplingParams(temperature=0, max_tokens=out_len))
        s.token_ids += [7] * (out_len // 2)  # mid-generation
        s.num_computed_tokens = s.num_tokens - 1
        s.block_table = list(range(i * 64, i * 64 + -(-s.num_tokens // BLOCK_SIZE)))
        seqs.append((s, 1))
    chunks, _ = plan_chunks(seqs)
    sender, flags = TableSender(), (False, True, False)
    messages = {
        "step_plan": ("step", [StepPlan.build(seqs, BLOCK_SIZE)[0]]),
        "wire_first": ("step", [sender.encode(chunks, *flags)]),
        "wire_steady": ("step", [sender.encode(chunks, *flags)]),
    }
    out = {"batch": len(seqs), "mean_context": statistics.mean(s.num_tokens for s, _ in seqs)}
    for key, cmd in messages.items():
        data = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        t = time.perf_counter()
        for _ in range(repeats):
            pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        dumps = (time.perf_counter() - t) / repeats
        t = time.perf_counter()
        for _ in range(repeats):
            pickle.loads(data)
        loads = (time.perf_counter() - t) / repeats
        out[key] = {"bytes": len(data), "pickle_us": dumps * 1e6, "unpickle_us": loads * 1e6}
    return out


def code_state() -> dict:
    """Which code was measured: where baton was imported from, its commit, and the uncommitted
    serving changes when that is a git checkout (others may be editing it while a run goes on)."""
    import baton.serve

    root = Path(baton.serve.__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return ""
        return run.stdout.strip() if run.returncode == 0 else ""

    dirty = git("status", "--porcelain", "--", "serve/parallel", "serve/runner/step_plan.py", "serve/engine/engine.py")
    commit = git("rev-parse", "--short", "HEAD")
    if not commit and (root / "COMMIT").exists():  # a `git archive` snapshot that names its commit
        commit = (root / "COMMIT").read_text().strip()
    return {"baton": str(root), "commit": commit, "uncommitted": dirty.splitlines()}


def median_row(runs: list[dict]) -> dict:
    """The run with the median throughput, with every run's throughput and load beside it, and the
    best run's: on a shared machine the best is the nearest to an idle one (other jobs only slow a run down)."""
    ordered = sorted(runs, key=lambda r: r["out_tok_per_s"])
    row = dict(ordered[len(ordered) // 2])
    row.pop("profile", None)  # kept once, beside the layouts
    row["runs_out_tok_per_s"] = [r["out_tok_per_s"] for r in runs]
    row["runs_decode_round_ms"] = [r["decode"]["round_ms"] for r in runs]
    row["decode_round_ms_median"] = statistics.median(row["runs_decode_round_ms"])
    row["runs_loadavg_1m"] = [r["loadavg_1m"] for r in runs]
    row["best_out_tok_per_s"] = ordered[-1]["out_tok_per_s"]
    row["best_decode_round_ms"] = min(row["runs_decode_round_ms"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny model, a few requests, one run each (CI)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="torch.profiler on the driver's batch-64 decode steps")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    spec = MODEL_SMOKE if args.smoke else MODEL_110M
    n_req, repeats = (4, 1) if args.smoke else (args.requests, args.repeats)
    decode_n = 4 if args.smoke else 32
    load_start = os.getloadavg()
    torch.manual_seed(0)
    cfg = ModelConfig(**spec)
    reqs = workload(n_req)
    # every request's whole context at once, plus the decode batch: no preemption in any layout
    need = sum(-(-(len(p) + o) // BLOCK_SIZE) for p, o in reqs)
    num_blocks = max(need, DECODE_BATCH * 4) + 64
    with tempfile.TemporaryDirectory(prefix="baton-serve-parallel-") as tmp:
        ckpt = save_model(Path(tmp) / "model", build_model(cfg, seed=0))
        runs: dict[str, list[dict]] = {k: [] for k in LAYOUTS}
        for i in range(repeats):  # interleaved, so drift in the machine's speed hits every layout alike
            for name in LAYOUTS:
                profile = args.profile and i == 0  # the first round: started on a quiet machine, if any
                runs[name].append(run_layout(ckpt, name, reqs, num_blocks, cfg.vocab_size, decode_n, profile))
                print(f"  run {i + 1}/{repeats} {name}: {runs[name][-1]['out_tok_per_s']:.0f} out tok/s", flush=True)
    rows = {k: median_row(v) for k, v in runs.items()}
    base = rows["T=1"]
    for row in rows.values():
        row["throughput_vs_T1"] = row["out_tok_per_s"] / base["out_tok_per_s"]
        row["best_throughput_vs_T1"] = row["best_out_tok_per_s"] / base["best_out_tok_per_s"]
        row["max_rank_weight_vs_T1"] = max(row["weight_bytes"]) / base["weight_bytes"][0]
        row["max_rank_kv_vs_T1"] = max(row["kv_bytes"]) / base["kv_bytes"][0]
    result = {
        "model": spec,
        "parameters": cfg.num_parameters(),
        "dtype": "float32",
        "cores": os.cpu_count(),
        "requests": n_req,
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "output_tokens": sum(o for _, o in reqs),
        "kv_blocks": num_blocks,
        "repeats": repeats,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "code": code_state(),
        "step_plan_64_decodes": plan_cost(reqs if len(reqs) >= DECODE_BATCH else workload(DECODE_BATCH)),
        "layouts": rows,
        "profile": {k: v[0]["profile"] for k, v in runs.items() if "profile" in v[0]},
        "runs": {k: [{f: x for f, x in run.items() if f != "profile"} for run in v] for k, v in runs.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_parallel.json").write_text(json.dumps(result, indent=2) + "\n")
    report(result)
    plot(result, args.out / "serve_parallel.png")


def report(r: dict) -> None:
    print(
        f"\nmodel: {r['parameters'] / 1e6:.1f}M params fp32, {r['cores']} cores; {r['requests']} requests "
        f"({r['prompt_tokens']} prompt, {r['output_tokens']} output tokens), {r['repeats']} interleaved runs each; "
        f"load {r['loadavg_start'][0]:.1f} at start, {r['loadavg_end'][0]:.1f} at end"
    )
    head = (
        f"{'layout':<7}{'thr':>4}{'out tok/s':>10}{'vs T=1':>8}{'TTFT mean/p50/p90 s':>22}"
        f"{'TPOT mean/p50/p90 ms':>23}{'dec64 ms':>10}{'ctrl ms':>9}{'weights/rank MiB':>18}{'KV/rank MiB':>13}"
    )
    print(head)
    for name, row in r["layouts"].items():
        ttft, tpot = row["ttft_s"], row["tpot_s"]
        ctrl = row.get("control_ms_per_step")
        print(
            f"{name:<7}{row['threads_per_rank']:>4}{row['out_tok_per_s']:>10.0f}{row['throughput_vs_T1']:>8.2f}"
            f"{ttft['mean']:>8.2f}/{ttft['p50']:.2f}/{ttft['p90']:.2f}"
            f"{tpot['mean'] * 1e3:>10.0f}/{tpot['p50'] * 1e3:.0f}/{tpot['p90'] * 1e3:.0f}"
            f"{row['decode_round_ms_median']:>10.1f}{'-' if ctrl is None else f'{ctrl:.2f}':>9}"
            f"{'/'.join(f'{b / 2**20:.0f}' for b in row['weight_bytes']):>18}"
            f"{'/'.join(f'{b / 2**20:.0f}' for b in row['kv_bytes']):>13}"
        )
        runs = " ".join(f"{x:.0f}" for x in row["runs_out_tok_per_s"])
        loads = " ".join(f"{a:.1f}" for a, _ in row["runs_loadavg_1m"])
        print(
            f"{'':<11}runs: {runs} out tok/s (load at start {loads}); best {row['best_out_tok_per_s']:.0f} "
            f"= {row['best_throughput_vs_T1']:.2f}x T=1's best, best dec64 {row['best_decode_round_ms']:.1f} ms"
        )
    p = r["step_plan_64_decodes"]
    print(f"control-plane message, {p['batch']} decodes (mean context {p['mean_context']:.0f}):")
    for key in ("step_plan", "wire_first", "wire_steady"):
        m = p[key]
        print(f"  {key:<12}{m['bytes']:>7} bytes  pickle {m['pickle_us']:.0f} us  unpickle {m['unpickle_us']:.0f} us")
    for name, prof in r["profile"].items():
        if prof:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in prof["ms_per_step"].items())
            print(f"profile {name}, batch-{DECODE_BATCH} decode step {prof['step_ms']:.1f} ms on the driver: {parts}")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["layouts"])
    rows = [r["layouts"][n] for n in names]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].bar(names, [x["out_tok_per_s"] for x in rows], color=[f"C{i}" for i in range(len(rows))])
    for i, x in enumerate(rows):
        ax[0].plot([i] * len(x["runs_out_tok_per_s"]), x["runs_out_tok_per_s"], "k.", ms=5)
    ax[0].set(ylabel="output tokens/s", title="throughput (bar: median, dots: runs)")
    width = 0.2
    for j, (key, q, scale) in enumerate((("ttft_s", "p50", 1), ("ttft_s", "p90", 1))):
        ax[1].bar(
            [i + (j - 0.5) * width for i in range(len(rows))],
            [x[key][q] * scale for x in rows],
            width,
            label=f"TTFT {q}",
        )
    ax1 = ax[1].twinx()
    for j, q in enumerate(("p50", "p90")):
        ax1.plot(
            range(len(rows)), [x["tpot_s"][q] * 1e3 for x in rows], "s--" if j else "o-", c="C3", label=f"TPOT {q}"
        )
    ax[1].set_xticks(range(len(rows)), names)
    ax[1].set(ylabel="TTFT (s)", title="latency (all requests at t=0)")
    ax1.set_ylabel("TPOT (ms)")
    ax1.set_ylim(bottom=0)
    ax[1].legend(loc="upper left")
    ax1.legend(loc="upper right")
    ranks = max(len(x["weight_bytes"]) for x in rows)
    for k in range(ranks):
        ax[2].bar(
            [i + (k - (ranks - 1) / 2) * 0.35 for i in range(len(rows))],
            [(x["weight_bytes"][k] + x["kv_bytes"][k]) / 2**20 if k < len(x["weight_bytes"]) else 0 for x in rows],
            0.35,
            label=f"rank {k}: weights + KV",
            color=f"C{k + 4}",
        )
        ax[2].bar(
            [i + (k - (ranks - 1) / 2) * 0.35 for i in range(len(rows))],
            [x["weight_bytes"][k] / 2**20 if k < len(x["weight_bytes"]) else 0 for x in rows],
            0.35,
            color=f"C{k + 4}",
            hatch="//",
            edgecolor="k",
        )
    ax[2].set_xticks(range(len(rows)), names)
    ax[2].set(ylabel="MiB per rank", title="memory per rank (hatched: weights)")
    ax[2].legend()
    fig.suptitle(f"{r['parameters'] / 1e6:.0f}M Llama, fp32, {r['cores']} CPU cores shared by all ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
