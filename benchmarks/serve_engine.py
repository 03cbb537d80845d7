"""Serving-engine benchmarks (issue: serving engine), all measured in one run on this machine.

  1. offline throughput on a ShareGPT-like mixed workload: Baton's engine vs HF `generate`
     (one request at a time, and static padded batches) on the same weights
  2. decode tokens/s at batch 1..64 against the fp32 matmul ceiling measured in the same run
  3. latency under load: TTFT and time-per-output-token p50/p99 at several Poisson request rates
  4. prefix caching on a long shared system prompt, cache on vs off
  5. KV-cache waste (allocated minus used slots) under the mixed workload
  6. StreamingLLM: KV blocks and per-token time over a stream 10x the model's context

Usage: python benchmarks/serve_engine.py [--quick]   (writes benchmarks/results/serve_engine.{json,png})

`--step-phases [--dtype fp32|bf16] [--baton-src DIR]`: instead, where one engine step's time goes
at batch 1/16/64 decode (context ~100) on serve_vs_vllm.py's 25M Llama: forward, LM head, sampler,
and the rest of the engine's Python (schedule, step plan, postprocess, outputs); --baton-src runs
the `baton` of another checkout (a worktree of an older commit: before/after in one run).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "--baton-src" in sys.argv:  # another checkout's baton, installed before anything imports baton
    from serve_vs_vllm import install_baton_source  # (this folder)

    install_baton_source(sys.argv[sys.argv.index("--baton-src") + 1])

import torch
from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.hf import export_hf
from baton.common.model import build_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)


REPEATS = 3


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """ShareGPT-like: log-normal prompt and output lengths (long tails), capped to fit the context."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        p = min(600, max(4, int(rng.lognormvariate(4.2, 0.9))))  # median ~67 tokens
        o = min(300, max(4, int(rng.lognormvariate(3.6, 0.8))))  # median ~37 tokens
        reqs.append(([rng.randrange(MODEL["vocab_size"]) for _ in range(p)], o))
    return reqs


def engine_for(ckpt: Path, **kw) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=kw.pop("max_num_seqs", 256), max_num_batched_tokens=kw.pop("budget", 2048))
    return LLMEngine.from_checkpoint(ckpt, EngineConfig(kv_cache_bytes=512 * 2**20, scheduler=sched, **kw))


def run_engine(engine: LLMEngine, reqs, arrivals: list[float] | None = None, sample_waste: bool = False):
    """Feed requests (at their arrival times if given); return wall time, per-request latencies and
    (if sample_waste: a separate run, since sampling every step costs time) the KV waste per step."""
    pending = list(enumerate(reqs))
    start = time.perf_counter()
    token_times: dict[str, list[float]] = {}
    waste = []
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and (arrivals is None or arrivals[pending[0][0]] <= now):
            i, (prompt, out_len) = pending.pop(0)
            engine.add_request(
                str(i),
                prompt,
                SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True),
                arrival_time=time.monotonic(),
            )
            token_times[str(i)] = [time.perf_counter()]
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        for out in engine.step():
            token_times[out.request_id] += [time.perf_counter()] * len(out.outputs[0].delta_token_ids)
        if sample_waste:
            held = sum(len([b for b in s.block_table if b >= 0]) for s in engine.scheduler.running)
            held *= engine.block_manager.block_size
            used = sum(s.num_computed_tokens - s.num_evicted_tokens for s in engine.scheduler.running)
            if held:
                waste.append((held - used) / held)
    wall = time.perf_counter() - start
    ttft = [t[1] - t[0] for t in token_times.values() if len(t) > 1]
    tpot = [(t[-1] - t[1]) / (len(t) - 2) for t in token_times.values() if len(t) > 2]
    return wall, ttft, tpot, waste


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


@torch.inference_mode()
def run_hf(hf, reqs, batch: int) -> float:
    """HF generate: static batches (left-padded to the longest prompt, run to the longest output)."""
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        n = max(o for _, o in chunk)
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def matmul_ceiling_gflops() -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    return 20 * 2 * 1024**3 / (time.perf_counter() - t) / 1e9


def decode_sweep(ckpt: Path, params: int, batches=(1, 2, 4, 8, 16, 32, 64)) -> list[dict]:
    rows = []
    for b in batches:
        engine = engine_for(ckpt, max_num_seqs=b, budget=4096)
        for i in range(b):
            engine.add_request(
                str(i), list(range(1, 17)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            )
        engine.step()  # prefill
        t, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        rows.append({"batch": b, "tokens_per_s": b * steps / (time.perf_counter() - t)})
    return rows


def streaming_run(tmp: Path, quick: bool) -> list[dict]:
    cfg = ModelConfig(**{**MODEL, "max_position_embeddings": 256})
    save_model(tmp / "stream", build_model(cfg, seed=1))
    engine = LLMEngine.from_checkpoint(
        tmp / "stream",
        EngineConfig(num_kv_blocks=64, block_size=16, streaming_sink_tokens=4, streaming_window_tokens=252),
    )
    total = 2560 if not quick else 768  # 10x the 256-token context
    engine.add_request("s", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=total, ignore_eos=True))
    rows, t, n = [], time.perf_counter(), 0
    while engine.has_unfinished_requests():
        blocks = engine.block_manager.num_used_blocks
        engine.step()
        n += 1
        if n % 128 == 0:
            rows.append({"tokens": n, "kv_blocks": blocks, "ms_per_token": (time.perf_counter() - t) / 128 * 1e3})
            t = time.perf_counter()
    return rows


def step_phases(dtype: str, batches=(1, 16, 64), steps: int = 30) -> dict:
    """ms per phase of LLMEngine.step, the faster half of `steps` decode steps per batch size."""
    import collections
    import functools

    import baton.serve.engine.engine as engine_module
    import serve_vs_vllm  # (this folder) its 25M checkpoint and limits

    ckpt = serve_vs_vllm.write_checkpoint(Path(tempfile.gettempdir()) / "baton-step-phases", "25M", dtype)
    sched = SchedulerConfig(**serve_vs_vllm.LIMITS)
    config = EngineConfig(kv_cache_bytes=2**30, enable_prefix_caching=False, scheduler=sched)
    engine = LLMEngine.from_checkpoint(ckpt, config, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    times: dict[str, list[float]] = collections.defaultdict(list)

    def timed(obj, name: str) -> None:
        f = getattr(obj, name)

        @functools.wraps(f)
        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                times[name].append(time.perf_counter() - t)

        setattr(obj, name, g)

    timed(engine.runner, "forward")  # (builds the step's tensors too)
    timed(engine.runner, "head")
    timed(engine_module, "sample")
    timed(engine, "step")
    rng, out = random.Random(0), {}
    for b in batches:
        for i in range(b):
            prompt = [rng.randrange(serve_vs_vllm.VOCAB) for _ in range(100)]
            engine.add_request(f"{b}-{i}", prompt, SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True))
        running = engine.scheduler.running
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in running):
            engine.step()
        for _ in range(3):
            engine.step()
        times.clear()
        for _ in range(steps):
            engine.step()
        fast = sorted(range(steps), key=lambda i: times["step"][i])[: steps // 2]
        ms = {k: sum(v[i] for i in fast) / len(fast) * 1e3 for k, v in times.items()}
        ms["engine_python"] = ms["step"] - ms["forward"] - ms["head"] - ms["sample"]
        out[b] = ms
        print(f"{dtype} batch {b}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()), flush=True)
        for rid in list(engine.requests):
            engine.abort_request(rid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--step-phases", action="store_true", help="only: where one step's time goes (25M model)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--baton-src", help="with --step-phases: import baton from this checkout")
    args = ap.parse_args()
    if args.step_phases:  # (--baton-src was installed at import)
        step_phases(args.dtype)
        return
    torch.manual_seed(0)
    n_req = 40 if args.quick else args.requests
    tmp = Path(tempfile.mkdtemp(prefix="baton-bench-"))
    cfg = ModelConfig(**MODEL)
    model = build_model(cfg, seed=0)
    ckpt = save_model(tmp / "model", model)
    params = cfg.num_parameters()
    results: dict = {"model": MODEL, "parameters": params, "threads": torch.get_num_threads()}

    reqs = workload(n_req)
    out_tokens = sum(o for _, o in reqs)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp / "hf")).eval()
    engine_runs, hf_static_runs = [], []
    for i in range(2 * REPEATS - 1):  # interleaved, so drift in the machine's speed hits both alike
        engine_runs.append(run_engine(engine_for(ckpt), reqs))  # 5 short runs: their median is stabler
        if i % 2 == 0:
            hf_static_runs.append(run_hf(hf, reqs, batch=16))  # 3 long ones
    wall, ttft, tpot, _ = sorted(engine_runs, key=lambda r: r[0])[len(engine_runs) // 2]
    waste = run_engine(engine_for(ckpt), reqs, sample_waste=True)[3]
    hf_static = statistics.median(hf_static_runs)
    hf_single = run_hf(hf, reqs, batch=1)  # every request: a subset's lengths would not be representative
    results["throughput"] = {
        "requests": n_req,
        "output_tokens": out_tokens,
        "baton": {"s": wall, "req_per_s": n_req / wall, "out_tok_per_s": out_tokens / wall},
        "hf_static_batch16": {"s": hf_static, "req_per_s": n_req / hf_static, "out_tok_per_s": out_tokens / hf_static},
        "hf_one_at_a_time": {"s": hf_single, "req_per_s": n_req / hf_single, "out_tok_per_s": out_tokens / hf_single},
        "speedup_vs_hf_static": hf_static / wall,
        "speedup_vs_hf_single": hf_single / wall,
        "runs_s": {"baton": [r[0] for r in engine_runs], "hf_static_batch16": hf_static_runs},
    }
    results["kv_waste"] = {"mean": statistics.mean(waste), "p99": pct(waste, 0.99)}

    ceiling = matmul_ceiling_gflops()
    sweep = decode_sweep(ckpt, params, (1, 4, 16, 64) if args.quick else (1, 2, 4, 8, 16, 32, 64))
    for row in sweep:
        row["ceiling_tokens_per_s"] = ceiling * 1e9 / (2 * params)
        row["fraction_of_ceiling"] = row["tokens_per_s"] / row["ceiling_tokens_per_s"]
    results["decode_sweep"] = {"matmul_gflops": ceiling, "rows": sweep}

    latency = []
    capacity = n_req / wall
    for frac in (0.25, 0.5, 0.75, 1.0):
        rate = capacity * frac
        rng = random.Random(1)
        t, arrivals = 0.0, []
        for _ in reqs:
            t += rng.expovariate(rate)
            arrivals.append(t)
        _, lt, lp, _ = run_engine(engine_for(ckpt), reqs, arrivals)
        latency.append(
            {
                "rate_req_per_s": rate,
                "ttft_p50": pct(lt, 0.5),
                "ttft_p99": pct(lt, 0.99),
                "tpot_p50": pct(lp, 0.5),
                "tpot_p99": pct(lp, 0.99),
                "ttft_all": sorted(lt),
            }
        )
    results["latency"] = latency

    system = list(range(3, 3 + 512))
    rng = random.Random(2)
    shared = [(system + [rng.randrange(2048) for _ in range(rng.randint(8, 40))], 16) for _ in range(n_req // 2)]
    prefix = {}
    for on in (True, False):
        engine = engine_for(ckpt, enable_prefix_caching=on)
        w, _, _, _ = run_engine(engine, shared)
        prefix["on" if on else "off"] = {
            "s": w,
            "req_per_s": len(shared) / w,
            "hit_rate": engine.block_manager.prefix_hit_rate,
        }
    prefix["speedup"] = prefix["off"]["s"] / prefix["on"]["s"]
    results["prefix_caching"] = prefix
    results["streaming"] = streaming_run(tmp, args.quick)

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve_engine.json").write_text(json.dumps(results, indent=2))
    report(results)
    plot(results)


def report(r: dict) -> None:
    t = r["throughput"]
    print(
        f"\nmodel: {r['parameters'] / 1e6:.1f}M params, {r['threads']} threads; {t['requests']} requests, {t['output_tokens']} output tokens"
    )
    print(f"{'system':<22}{'s':>8}{'req/s':>9}{'out tok/s':>11}")
    for k in ("baton", "hf_static_batch16", "hf_one_at_a_time"):
        print(f"{k:<22}{t[k]['s']:>8.1f}{t[k]['req_per_s']:>9.2f}{t[k]['out_tok_per_s']:>11.0f}")
    print(
        f"speedup vs HF static batching: {t['speedup_vs_hf_static']:.1f}x; vs one at a time: {t['speedup_vs_hf_single']:.1f}x"
    )
    print(
        f"  (medians of interleaved runs: Baton {[round(x, 2) for x in t['runs_s']['baton']]} s, "
        f"HF static {[round(x, 2) for x in t['runs_s']['hf_static_batch16']]} s)"
    )
    print(f"KV waste: mean {r['kv_waste']['mean']:.1%}, p99 {r['kv_waste']['p99']:.1%}")
    d = r["decode_sweep"]
    print(
        f"\ndecode (fp32 matmul ceiling {d['matmul_gflops']:.0f} GFLOP/s)\n{'batch':>6}{'tok/s':>10}{'ceiling':>10}{'frac':>8}"
    )
    for row in d["rows"]:
        print(
            f"{row['batch']:>6}{row['tokens_per_s']:>10.0f}{row['ceiling_tokens_per_s']:>10.0f}{row['fraction_of_ceiling']:>8.1%}"
        )
    print(f"\n{'rate req/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}  (seconds)")
    for row in r["latency"]:
        print(
            f"{row['rate_req_per_s']:>10.2f}{row['ttft_p50']:>10.3f}{row['ttft_p99']:>10.3f}{row['tpot_p50']:>10.4f}{row['tpot_p99']:>10.4f}"
        )
    p = r["prefix_caching"]
    print(
        f"\nprefix caching (512-token shared prompt): on {p['on']['req_per_s']:.2f} req/s (hit rate {p['on']['hit_rate']:.0%}), "
        f"off {p['off']['req_per_s']:.2f} req/s -> {p['speedup']:.1f}x"
    )
    print("\nStreamingLLM (context 256, stream to 10x):")
    for row in r["streaming"]:
        print(f"  tokens {row['tokens']:>5}: {row['kv_blocks']} KV blocks, {row['ms_per_token']:.2f} ms/token")


def plot(r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    rows = r["decode_sweep"]["rows"]
    ax[0].plot([x["batch"] for x in rows], [x["tokens_per_s"] for x in rows], "o-", label="Baton decode")
    ax[0].axhline(rows[0]["ceiling_tokens_per_s"], ls="--", c="gray", label="fp32 matmul ceiling")
    ax[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s", title="decode throughput vs batch")
    ax[0].legend()
    for row in r["latency"]:
        xs = row["ttft_all"]
        ax[1].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{row['rate_req_per_s']:.1f} req/s")
    ax[1].set(xscale="log", xlabel="TTFT (s)", ylabel="CDF", title="TTFT under load")
    ax[1].legend()
    s = r["streaming"]
    ax[2].plot([x["tokens"] for x in s], [x["ms_per_token"] for x in s], "o-", label="ms/token")
    ax2 = ax[2].twinx()
    ax2.plot([x["tokens"] for x in s], [x["kv_blocks"] for x in s], "s--", c="C1", label="KV blocks")
    ax[2].set(xlabel="tokens streamed", title="StreamingLLM: flat time and memory")
    ax[2].set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(RESULTS / "serve_engine.png", dpi=110)


if __name__ == "__main__":
    main()
