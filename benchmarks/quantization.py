"""Quantization and pruning benchmarks (issue 9), all measured in one run on this machine.

  1. quality on the demo model (`baton demo`, trained on the embedded corpus): method x bits ->
     held-out perplexity and its delta vs fp32, top-1 / greedy agreement, checkpoint size
  2. KV-cache int8 / fp8: greedy agreement with the float cache through the engine, bytes per block
  3. pruning curve on the demo model: perplexity vs % of parameters removed (no recovery fine-tune)
  4. CPU matmul paths per format (what the quantized linears can call), one decode-sized GEMM
  5. serving a larger random-init model: decode tokens/s at batch 1 and 16 and peak RSS per format,
     each in a fresh process so peak memory is that configuration's alone

Usage: python benchmarks/quantization.py [--demo CKPT] [--quick]
       (writes benchmarks/results/quantization.{json,png}; without --demo it trains one first)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from baton.common.checkpoint import load_checkpoint, save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.common.tokenizer import Tokenizer
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.eval import EvalConfig, evaluate, heldout_tokens
from baton.serve.quantization import QuantConfig, load_model, quantize_model, save_quantized
from baton.serve.quantization.calibration import CalibrationConfig
from baton.serve.quantization.linear import set_compute_dtype
from baton.serve.quantization.prune import PruneConfig, prune_checkpoint
from baton.serve.quantization.quantize import quantize_checkpoint
from baton.serve.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = "quality,kv_cache,pruning,matmul_paths,speed"
SPEED_MODEL = dict(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
METHODS = [  # (label, config)
    ("RTN int8", QuantConfig("rtn", 8)),
    ("GPTQ int8", QuantConfig("gptq", 8)),
    ("RTN int4 g128", QuantConfig("rtn", 4, 128)),
    ("GPTQ int4 g128", QuantConfig("gptq", 4, 128)),
    ("GPTQ int4 g128 act-order", QuantConfig("gptq", 4, 128, act_order=True)),
    ("AWQ int4 g128", QuantConfig("awq", 4, 128)),
    ("RTN int4 g32", QuantConfig("rtn", 4, 32)),
    ("GPTQ int4 g32", QuantConfig("gptq", 4, 32)),
    ("AWQ int4 g32", QuantConfig("awq", 4, 32)),
    ("SmoothQuant W8A8 a=0.5", QuantConfig("smoothquant", 8, alpha=0.5)),
    ("SmoothQuant W8A8 a=auto", QuantConfig("smoothquant", 8, alpha=None)),
    ("FP8 e4m3", QuantConfig("fp8", 8)),
]
SPEED_FORMATS = [  # (label, QuantConfig or None for float, weight dtype, activation dtype in the quantized linears)
    ("fp32", None, "float32", None),
    ("bf16", None, "bfloat16", None),
    ("int8 (fp32 act)", QuantConfig("rtn", 8), "float32", None),
    ("int8 (bf16 act)", QuantConfig("rtn", 8), "float32", "bfloat16"),
    ("int4 g128", QuantConfig("rtn", 4, 128), "float32", None),
    ("W8A8", QuantConfig("smoothquant", 8), "float32", None),
    ("fp8", QuantConfig("fp8", 8), "float32", None),
]


def size_mb(ckpt: Path) -> float:
    return sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**20


def quality(demo: Path, work: Path, quick: bool) -> list[dict]:
    tok = Tokenizer.from_dir(demo)
    ecfg = EvalConfig(max_tokens=4096 if quick else None)
    tokens = heldout_tokens(ecfg, tok)
    ref = load_checkpoint(demo).model.eval()
    base = evaluate(ref, tokens, ecfg)
    rows = [
        {
            "method": "fp32",
            "bits": 32,
            "perplexity": base.perplexity,
            "delta": 0.0,
            "top1": 1.0,
            "greedy": 1.0,
            "size_mb": size_mb(demo),
            "seconds": 0.0,
        }
    ]
    calib = CalibrationConfig(num_samples=32 if quick else 128)
    for label, qcfg in METHODS[:4] if quick else METHODS:
        t = time.perf_counter()
        out = quantize_checkpoint(demo, work / label.replace(" ", "_"), qcfg, calib)
        seconds = time.perf_counter() - t
        model = load_model(out).model.eval()
        for act, suffix in ((None, ""), (torch.bfloat16, " (bf16 act)")) if qcfg.format == "int8" else ((None, ""),):
            set_compute_dtype(model, act)
            r = evaluate(model, tokens, ecfg, ref)
            rows.append(
                {
                    "method": label + suffix,
                    "bits": qcfg.bits,
                    "perplexity": r.perplexity,
                    "delta": r.perplexity_delta,
                    "top1": r.top1_agreement,
                    "greedy": r.greedy_match,
                    "size_mb": size_mb(out),
                    "seconds": seconds,
                }
            )
    return rows


def kv_quality(demo: Path, quick: bool) -> list[dict]:
    """Greedy continuations of held-out prompts with a quantized KV cache vs the float cache."""
    tokens = heldout_tokens(EvalConfig(), Tokenizer.from_dir(demo))
    prompts = [tokens[i : i + 64].tolist() for i in range(0, 64 * (8 if quick else 32), 64)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rows, ref = [], None
    for kind in ("auto", "int8", "fp8"):
        engine = LLMEngine.from_checkpoint(demo, EngineConfig(num_kv_blocks=512, kv_cache_dtype=kind))
        outs = [o.outputs[0].token_ids for o in _generate(engine, prompts, params)]
        ref = ref or outs
        prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) / len(r) for o, r in zip(outs, ref)]
        same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r)) / sum(map(len, ref))
        rows.append(
            {
                "kv_cache": kind,
                "block_bytes": engine.runner.kv_caches[0][0][0].nbytes * 2 * len(engine.runner.kv_caches),
                "token_agreement": same,
                "greedy_match": sum(prefix) / len(prefix),
            }
        )
    return rows


def _generate(engine: LLMEngine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
    return [done[i] for i in range(len(prompts))]


def pruning(demo: Path, work: Path, quick: bool) -> list[dict]:
    tok, ecfg = Tokenizer.from_dir(demo), EvalConfig(max_tokens=4096 if quick else None)
    tokens = heldout_tokens(ecfg, tok)
    base = load_checkpoint(demo)
    params0 = base.config.num_parameters()
    rows = [
        {
            "heads": 0.0,
            "channels": 0.0,
            "removed": 0.0,
            "perplexity": evaluate(base.model.eval(), tokens, ecfg).perplexity,
        }
    ]
    grid = (
        [(0, 0.25), (0, 0.5)]
        if quick
        else [(0, 0.125), (0, 0.25), (0, 0.375), (0, 0.5), (0, 0.75), (0.5, 0), (0.5, 0.25), (0.5, 0.5)]
    )
    for heads, channels in grid:
        out = prune_checkpoint(
            demo, work / f"prune-{heads}-{channels}", PruneConfig(heads, channels), CalibrationConfig(num_samples=32)
        )
        ckpt = load_checkpoint(out)
        rows.append(
            {
                "heads": heads,
                "channels": channels,
                "removed": 1 - ckpt.config.num_parameters() / params0,
                "perplexity": evaluate(ckpt.model.eval(), tokens, ecfg).perplexity,
            }
        )
    return rows


def _time(fn, reps: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def matmul_paths(m: int = 1, k: int = 2816, n: int = 1024) -> dict[str, float]:
    """ms for one [m, k] x [k, n] product per path (decode-sized, the shape of a down_proj)."""
    from baton.kernels.quant import quantize_fp8_per_channel, quantize_int4_groupwise, quantize_int8_per_channel
    from baton.kernels.quant_matmul import fp8_weight_matmul, int4_weight_matmul, int8_weight_matmul
    from baton.kernels.w8a8 import quantize_per_token, w8a8_matmul

    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k)
    xb, wb = x.bfloat16(), w.bfloat16()
    q8, s8 = quantize_int8_per_channel(w)
    p4, s4, z4 = quantize_int4_groupwise(w, 128)
    f8, sf = quantize_fp8_per_channel(w)
    tiny = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    sz = torch.randn(k // 128, n, 2, dtype=torch.bfloat16)
    return {
        "fp32 F.linear": _time(lambda: torch.nn.functional.linear(x, w)),
        "bf16 F.linear": _time(lambda: torch.nn.functional.linear(xb, wb)),
        "int8 weight, fp32 act (_weight_int8pack_mm)": _time(lambda: int8_weight_matmul(x, q8, s8)),
        "int8 weight, bf16 act (_weight_int8pack_mm)": _time(lambda: int8_weight_matmul(xb, q8, s8)),
        "int4 weight (kernels CPU path: dequantize + matmul)": _time(lambda: int4_weight_matmul(x, p4, s4, z4, 128)),
        "int4 weight, bf16 act (_weight_int4pack_mm_for_cpu, not wired)": _time(
            lambda: torch._weight_int4pack_mm_for_cpu(xb, tiny, 128, sz)
        ),
        "W8A8 (quantize_per_token + _int_mm)": _time(
            lambda: w8a8_matmul(*quantize_per_token(x), q8, s8, torch.float32)
        ),
        "fp8 weight (dequantize + matmul)": _time(lambda: fp8_weight_matmul(x, f8, sf), reps=3),
    }


def serve_one(ckpt: str, act: str | None, batch: int, new_tokens: int) -> dict:
    """Runs in a fresh process: decode tokens/s (after prefill) and this process's peak RSS."""
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=64 * max(1, batch // 4), block_size=16))
    set_compute_dtype(engine.model, getattr(torch, act) if act else None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, engine.vocab_size, (16,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    best = 0.0
    for _ in range(3):  # best of three: the first warms up, and the CPU is shared
        for i, p in enumerate(prompts):
            engine.add_request(f"{time.monotonic()}-{i}", p, params)
        engine.step()  # prefill (+ first token)
        t = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        best = max(best, batch * steps / (time.perf_counter() - t))
    import psutil

    # VmHWM, not getrusage's ru_maxrss: Linux carries the parent's peak into a forked-and-exec'd child.
    hwm = next(
        int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM")
    )
    return {"tokens_per_s": best, "rss_mb": psutil.Process().memory_info().rss / 2**20, "peak_rss_mb": hwm / 1024}


def speed(work: Path, quick: bool) -> list[dict]:
    cfg = ModelConfig(**SPEED_MODEL)
    float_dir = save_model(work / "speed-fp32", build_model(cfg, seed=0))
    rows = []
    for label, qcfg, wdtype, act in SPEED_FORMATS[:4] if quick else SPEED_FORMATS:
        ckpt = work / f"speed-{label.split()[0]}"
        if not ckpt.exists():
            model = load_checkpoint(float_dir, dtype=getattr(torch, wdtype)).model
            if qcfg is None:
                model.config.torch_dtype = wdtype
                save_model(ckpt, model)
            else:
                save_quantized(ckpt, quantize_model(model, qcfg, torch.randint(0, cfg.vocab_size, (8, 512))), qcfg)
        row = {"format": label, "weights_mb": size_mb(ckpt)}
        for batch in (1, 16):
            cmd = [
                sys.executable,
                __file__,
                "--serve-one",
                str(ckpt),
                "--batch",
                str(batch),
                "--act",
                act or "",
                "--threads",
                str(torch.get_num_threads()),
                "--new-tokens",
                "8" if quick else "32",
            ]
            r = json.loads(
                subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            )
            row[f"tok_s_b{batch}"], row[f"rss_mb_b{batch}"], row[f"peak_mb_b{batch}"] = (
                r["tokens_per_s"],
                r["rss_mb"],
                r["peak_rss_mb"],
            )
        rows.append(row)
        print(
            f"  {label:<18} {row['weights_mb']:8.1f} MB  b1 {row['tok_s_b1']:7.1f} tok/s  b16 {row['tok_s_b16']:7.1f} tok/s  "
            f"RSS {row['rss_mb_b16']:.0f} MB (peak {row['peak_mb_b16']:.0f})",
            flush=True,
        )
    return rows


def report(r: dict) -> None:
    print(f"\nquality on the demo model ({r['demo']}), held-out perplexity (window 128, stride 64)")
    print(f"{'method':<30}{'ppl':>8}{'delta':>9}{'top1':>7}{'greedy':>8}{'MB':>7}{'quant s':>9}")
    for x in r["quality"]:
        print(
            f"{x['method']:<30}{x['perplexity']:>8.3f}{x['delta']:>+9.2%}{x['top1']:>7.3f}{x['greedy']:>8.3f}"
            f"{x['size_mb']:>7.2f}{x['seconds']:>9.1f}"
        )
    print(f"\n{'KV cache':<10}{'bytes/block':>12}{'token agree':>13}{'greedy':>8}")
    for x in r["kv_cache"]:
        print(f"{x['kv_cache']:<10}{x['block_bytes']:>12}{x['token_agreement']:>13.3f}{x['greedy_match']:>8.3f}")
    print(f"\n{'pruned heads/channels':<24}{'% params':>9}{'ppl':>9}")
    for x in r["pruning"]:
        print(f"{x['heads']:.3f}/{x['channels']:.3f}{'':<12}{x['removed']:>9.1%}{x['perplexity']:>9.2f}")
    print("\nCPU matmul paths, [1 x 2816] x [2816 x 1024] (ms)")
    for k, v in r["matmul_paths"].items():
        print(f"  {k:<62}{v:>8.3f}")
    print(
        f"\nserving {r['speed_params'] / 1e6:.0f}M-param random model, decode tokens/s and memory (fresh process each;"
        " RSS = resident after serving, peak = max incl. loading)"
    )
    print(f"{'format':<18}{'weights MB':>11}{'b1 tok/s':>10}{'b16 tok/s':>11}{'RSS b16 MB':>12}{'peak b16 MB':>13}")
    for x in r["speed"]:
        print(
            f"{x['format']:<18}{x['weights_mb']:>11.1f}{x['tok_s_b1']:>10.1f}{x['tok_s_b16']:>11.1f}"
            f"{x['rss_mb_b16']:>12.0f}{x['peak_mb_b16']:>13.0f}"
        )


def plot(r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(17, 4.5))
    q = [x for x in r["quality"] if x["method"] != "fp32"]
    ax[0].barh([x["method"] for x in q], [100 * x["delta"] for x in q])
    ax[0].set(xlabel="perplexity delta vs fp32 (%)", title="demo model: quality per method")
    ax[0].invert_yaxis()
    p = sorted(r["pruning"], key=lambda x: x["removed"])
    for heads in sorted({x["heads"] for x in p}):
        pts = [x for x in p if x["heads"] == heads or x["removed"] == 0]
        ax[1].plot(
            [100 * x["removed"] for x in pts], [x["perplexity"] for x in pts], "o-", label=f"heads removed {heads:.0%}"
        )
    ax[1].set(xlabel="% parameters removed", ylabel="perplexity", title="structured pruning (no recovery fine-tune)")
    ax[1].legend()
    s = r["speed"]
    ax[2].bar([i - 0.2 for i in range(len(s))], [x["tok_s_b1"] for x in s], 0.4, label="batch 1")
    ax[2].bar([i + 0.2 for i in range(len(s))], [x["tok_s_b16"] / 16 for x in s], 0.4, label="batch 16 (per sequence)")
    ax[2].set_xticks(range(len(s)), [x["format"] for x in s], rotation=30, ha="right")
    ax[2].set(ylabel="decode tokens/s", title=f"{r['speed_params'] / 1e6:.0f}M model decode on CPU")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "quantization.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", type=Path, default=None, help="a demo handoff checkpoint (default: train one)")
    ap.add_argument("--quick", action="store_true", help="fewer methods and tokens (smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see below)")
    ap.add_argument("--sections", default=SECTIONS, help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--serve-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--act", default="", help=argparse.SUPPRESS)
    ap.add_argument("--new-tokens", type=int, default=32, help=argparse.SUPPRESS)
    args = ap.parse_args()
    # One thread: on a shared 2-core machine, two OpenMP threads spin-waiting on each other made a
    # forward ~25x slower; one thread gives stable, comparable numbers (recorded in the JSON).
    torch.set_num_threads(args.threads)
    if args.serve_one:
        print(json.dumps(serve_one(args.serve_one, args.act or None, args.batch, args.new_tokens)))
        return
    work = Path(tempfile.mkdtemp(prefix="baton-quant-bench-"))
    sections = args.sections.split(",")
    r: dict = {
        "threads": torch.get_num_threads(),
        "speed_model": SPEED_MODEL,
        "speed_params": ModelConfig(**SPEED_MODEL).num_parameters(),
    }
    demo = args.demo
    if demo is None and {"quality", "kv_cache", "pruning"} & set(sections):
        from baton.serve.demo import run_demo

        run_demo(work / "demo")
        demo = work / "demo" / "handoff"
    if demo is not None:
        r["demo"] = str(demo)
    RESULTS.mkdir(exist_ok=True)
    if args.sections != SECTIONS:  # re-measure some sections, keep the others from the last run
        r = {**json.loads((RESULTS / "quantization.json").read_text()), **r}
    for key, section in (
        ("quality", lambda: quality(demo, work, args.quick)),
        ("kv_cache", lambda: kv_quality(demo, args.quick)),
        ("pruning", lambda: pruning(demo, work, args.quick)),
        ("matmul_paths", matmul_paths),
        ("speed", lambda: speed(work, args.quick)),
    ):
        if key not in sections:
            continue
        print(f"{key} ...", flush=True)
        r[key] = section()
        (RESULTS / "quantization.json").write_text(json.dumps(r, indent=2))  # partial results survive a failure
    report(r)
    plot(r)


if __name__ == "__main__":
    main()
