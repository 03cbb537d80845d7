"""Reliability: what "a request can fail only itself" costs and what fault injection leaves behind.

  1. the sampler's numeric guards (NaN/inf cleaning, finiteness checks, greedy fallback) per step,
     timed alone next to the whole sample() call and the engine's decode step at the same batch
  2. fault injection on one engine: requests whose post-processing raises, and one batched forward
     that raises, beside ordinary requests. Counts of failed/ok requests, whether every ordinary
     output equals a fault-free run of the same requests, the KV pool afterwards, and the engine's
     throughput with and without the faults (same workload, interleaved repeats)

The fuzz run against a real `baton serve` is tests/serve/test_fuzz_sampling.py (run it with -s for
its counts). Usage: python benchmarks/reliability.py [--quick]   (writes results/reliability.{json,png})
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.serve.core.faults import InjectedFault
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampler import finite_logits, sample
from baton.serve.sampling_params import SamplingParams
from serve_engine import MODEL, RESULTS  # noqa: E402 - the same model as the engine benchmark (script dir is on sys.path)

MIXED = [
    SamplingParams(temperature=0, max_tokens=48),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=48),
    SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.2, seed=2, max_tokens=48),
    SamplingParams(temperature=0.7, min_p=0.05, presence_penalty=0.5, seed=3, max_tokens=48),
]


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def guard_cost(vocab: int, batches: tuple[int, ...], repeats: int) -> list[dict]:
    """The guards' own work per step: finite_logits over the batch plus the per-row finiteness checks
    target_distribution makes, against sample() on the same rows with mixed parameters."""
    rows = []
    for b in batches:
        logits = torch.randn(b, vocab) * 4
        seqs = [Sequence(i, str(i), 0, [1, 2, 3], MIXED[i % len(MIXED)], 0, 0.0) for i in range(b)]
        for s in seqs:
            s.make_generator()

        probs = torch.softmax(logits, -1)
        sampled = [r for r in range(b) if not MIXED[r % len(MIXED)].greedy]

        def guards():  # what the sampler adds to a plain softmax + draw
            clean = finite_logits(logits)
            for r in sampled:  # greedy rows without penalties take the batched argmax: no per-row checks
                bool(torch.isfinite(clean[r].max())) and bool(torch.isfinite(probs[r]).all()) and float(
                    probs[r].sum()
                ) > 0

        g, s = timed(guards, repeats), timed(lambda: sample(logits, seqs), repeats)
        batch_guard = timed(lambda: finite_logits(logits), repeats)  # all a greedy batch pays
        rows.append(
            dict(
                vocab=vocab,
                batch=b,
                guards_us=g * 1e6,
                sample_us=s * 1e6,
                share=g / s,
                batch_guard_us=batch_guard * 1e6,
            )
        )
    return rows


def workload(n: int) -> list[tuple[str, list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(0)
    return [
        (
            f"r{i}",
            torch.randint(
                0, MODEL["vocab_size"], (int(torch.randint(8, 96, (1,), generator=g)),), generator=g
            ).tolist(),
            MIXED[i % len(MIXED)],
        )
        for i in range(n)
    ]


def run(engine: LLMEngine, reqs, inject=None) -> tuple[dict, float]:
    """Outputs (token ids per sample, or the error) of every request, and seconds."""
    engine.fault_injector = inject
    for rid, ids, params in reqs:
        engine.add_request(rid, ids, params)
    outs, t0 = {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.error or [c.token_ids for c in out.outputs]
    return outs, time.perf_counter() - t0


def fault_injection(ckpt: Path, n: int, repeats: int) -> dict:
    """Phase 1: every 8th request's post-processing raises after 3 tokens. Phase 2: four requests
    whose first forward raises. Then the same four again, fault-free. Every request is greedy or
    seeded, so a fault-free run of the same requests is the reference for the ones that survive."""
    reqs, late = workload(n), workload(4)
    faulty = {rid for rid, _, _ in reqs[::8]}

    def post_fault(point: str, seq) -> None:
        if point == "postprocess" and seq.request_id in faulty and seq.num_output_tokens >= 3:
            raise InjectedFault(f"injected post-processing fault for {seq.request_id}")

    def forward_fault(point: str, seq) -> None:
        if point == "forward":
            raise InjectedFault("injected forward fault")

    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=1024, block_size=16))
    clean_times, fault_times = [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        reference, t = run(engine, reqs)
        clean_times.append(t)
        faulted, t = run(engine, reqs, post_fault)
        fault_times.append(t)
    hit, _ = run(engine, late, forward_fault)
    late_reference, _ = run(engine, late)
    after, _ = run(engine, late)
    failed = {rid for rid, o in faulted.items() if isinstance(o, str)}
    ok = [rid for rid in faulted if rid not in failed]
    bm = engine.block_manager
    return dict(
        requests=n,
        injected_postprocess=len(faulty),
        failed=len(failed),
        failed_as_injected=failed == faulty,
        ok=len(ok),
        ok_equal_to_fault_free_run=sum(faulted[r] == reference[r] for r in ok),
        forward_fault_requests=len(late),
        forward_fault_failed=sum(isinstance(o, str) for o in hit.values()),
        after_forward_fault_equal=after == late_reference,
        kv_pool_whole=bm.num_free_blocks == bm.num_blocks,
        clean_s=statistics.median(clean_times),
        faulted_s=statistics.median(fault_times),
    )


def decode_step_ms(ckpt: Path, batch: int, repeats: int) -> float:
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=1024, block_size=16))
    for i in range(batch):
        engine.add_request(str(i), [1 + i, 2, 3, 4], SamplingParams(temperature=0, max_tokens=10**4, ignore_eos=True))
    for _ in range(3):
        engine.step()  # prefill and warm-up
    return timed(engine.step, repeats) * 1e3


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for vocab in sorted({r["vocab"] for r in results["guards"]}):
        rows = [r for r in results["guards"] if r["vocab"] == vocab]
        a.plot(
            [r["batch"] for r in rows],
            [100 * r["share"] for r in rows],
            marker="o",
            label=f"vocab {vocab}: per-row guards, % of sample() (mixed params)",
        )
        if rows[0].get("decode_step_ms"):
            a.plot(
                [r["batch"] for r in rows],
                [r["batch_guard_us"] / 10 / r["decode_step_ms"] for r in rows],
                marker="s",
                label=f"vocab {vocab}: batch guard, % of a greedy decode step",
            )
    a.set(xscale="log", xlabel="batch", ylabel="guard time (%)", title="Numeric guards per step")
    a.legend()
    f = results["fault_injection"]
    b.bar(["fault-free", "with faults"], [f["clean_s"], f["faulted_s"]], color=["tab:blue", "tab:orange"])
    b.set(ylabel="seconds for the workload", title=f"{f['requests']} requests, {f['failed']} failed on purpose")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    args = ap.parse_args()
    repeats = 3 if args.quick else 7
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_model(Path(tmp) / "model", build_model(ModelConfig(**MODEL)).eval())
        batches = (1, 8, 32) if args.quick else (1, 4, 16, 64)
        guards = guard_cost(MODEL["vocab_size"], batches, repeats * 3) + guard_cost(32000, batches, repeats * 3)
        steps = {b: decode_step_ms(ckpt, b, repeats * 3) for b in batches}
        for r in guards:
            if r["vocab"] == MODEL["vocab_size"]:
                r["decode_step_ms"] = steps[r["batch"]]
        faults = fault_injection(ckpt, 24 if args.quick else 96, 2 if args.quick else 3)
    results = dict(guards=guards, fault_injection=faults)
    print(
        f"{'vocab':>6} {'batch':>5} {'row guards us':>13} {'sample() us':>12} {'share':>7} "
        f"{'batch guard us':>15} {'decode step ms':>15}"
    )
    for r in guards:
        step = f"{r['decode_step_ms']:.2f}" if "decode_step_ms" in r else "-"
        print(
            f"{r['vocab']:>6} {r['batch']:>5} {r['guards_us']:>13.1f} {r['sample_us']:>12.1f} {r['share']:>6.1%} "
            f"{r['batch_guard_us']:>15.1f} {step:>15}"
        )
    print(json.dumps(faults, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reliability.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "reliability.png")
    print(f"wrote {RESULTS / 'reliability.json'} and reliability.png")


if __name__ == "__main__":
    main()
