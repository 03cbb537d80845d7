"""Check the serving engine on CUDA against the same engine on CPU (fp32, greedy), then time both.

    python benchmarks/engine_gpu.py            # on a GPU: TP=1, and TP=2 when there are two devices
    python benchmarks/engine_gpu.py --smoke    # no GPU: TP=2 on CPU against the CPU reference

Through the device tool (its image has torch and triton but not Baton; nothing to fetch there), one call
(BATON_CPU_KERNELS=0: the CPU reference takes the torch decode path instead of building the C++
kernel first, ~20 s of device time; both paths are checked against each other in CI):

    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . && \
    BATON_CPU_KERNELS=0 PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/engine_gpu.py --out $OUT 2>&1 | tee $OUT/log.txt

A random-weight Llama (the engine benchmark's MODEL: 4M parameters, GQA 8/4, vocab 2048) serves
the same prompts (mixed lengths, one past a block boundary, one chunked over several steps) through
`LLM` on CPU (the reference, TP=1) and on CUDA (the paged decode and prefill Triton kernels, cuBLAS,
and for TP=2 the sharded model with NCCL all-reduces). Every greedy token must equal the CPU's.
Different kernels round differently, so a sequence may part from the reference at a near-tie: the
reference's two best tokens within TIE in log-probability there (checked with its logprobs); after
that point the tokens are not compared. Any other difference is a failure. TF32 is off everywhere
(cuBLAS through NVIDIA_TF32_OVERRIDE=0, which the spawned workers inherit; the kernels keep fp32 in
tl.dot). Throughput: output tokens/s of each run (on CUDA a second, timed run: the first one
compiles the Triton kernels). Writes OUT/engine_gpu.{json,png} (OUT: --out, by default benchmarks/results; a
temporary folder in smoke mode, whose timings mean nothing). Exit status 1 if any check fails,
2 without CUDA (and no --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")  # before CUDA starts, here and in every spawned worker

import torch  # noqa: E402
from baton.common.checkpoint import save_model  # noqa: E402
from baton.common.config import ModelConfig  # noqa: E402
from baton.common.model import build_model  # noqa: E402
from baton.serve import LLM, SamplingParams  # noqa: E402
from baton.serve.engine import EngineConfig  # noqa: E402
from baton.serve.scheduling.scheduler import SchedulerConfig  # noqa: E402
from serve_engine import MODEL, RESULTS  # noqa: E402 - the engine benchmark's (script dir is on sys.path)

TIE = 1e-4  # log-probability gap under which two kernels may pick either token
MAX_TOKENS = 48
SMOKE_TOKENS = 12  # the smoke run checks that the script works, not the kernels
NUM_BLOCKS = 512  # fixed, so both devices schedule alike (and the GPU's pool is not sized from 139 GiB)
SECTIONS = ("tp1", "tp2")
CHECKS: list[dict] = []
ROWS: list[dict] = []
FAILURES: list[str] = []


def prompts() -> list[list[int]]:
    """Mixed lengths: short, one block (16) and a token, long, and one longer than a step's budget."""
    rng = random.Random(0)
    lengths = [1, 5, 16, 17, 33, 64, 100, 130, 250, 600]
    return [[rng.randrange(MODEL["vocab_size"]) for _ in range(n)] for n in lengths]


def engine_config() -> EngineConfig:
    """A 256-token step budget, so the 600-token prompt is prefilled in chunks beside decodes."""
    return EngineConfig(num_kv_blocks=NUM_BLOCKS, scheduler=SchedulerConfig(max_num_batched_tokens=256))


def generate(ckpt: Path, device: str, tp: int, max_tokens: int) -> tuple[list[list[int]], list[list[dict]], float]:
    """(tokens, logprobs, output tokens/s) for every prompt; on CUDA from a second run (the first
    compiles the Triton kernels)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    with LLM(ckpt, engine_config(), device=device, dtype=torch.float32, tensor_parallel_size=tp) as llm:
        if device == "cuda":
            llm.generate(prompts(), params)
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts(), params)
        wall = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in outs]
    return tokens, [o.outputs[0].logprobs for o in outs], sum(map(len, tokens)) / wall


def compare(name: str, ref: tuple, got: tuple) -> None:
    """Every sequence equal to the reference, or parting from it only at a near-tie of the reference."""
    parted, failed = [], []
    for i, (a, b, lp) in enumerate(zip(ref[0], got[0], ref[1])):
        if a == b:
            continue
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if j == min(len(a), len(b)):
            failed.append(f"prompt {i}: {len(b)} tokens, reference {len(a)}")
            continue
        gap = lp[j][a[j]] - lp[j].get(b[j], float("-inf"))
        (parted if gap <= TIE else failed).append(
            f"prompt {i} token {j}: {b[j]} where the reference has {a[j]} (log-prob gap {gap:.2e})"
        )
    ok = not failed
    CHECKS.append({"name": name, "ok": ok, "sequences": len(ref[0]), "near_ties": parted, "failures": failed})
    ties = f", {len(parted)} parted at a near-tie" if parted else ""
    equal = len(ref[0]) - len(parted) - len(failed)
    print(f"  check {name}: {equal} of {len(ref[0])} sequences equal{ties}  {'ok' if ok else 'FAIL'}")
    for line in parted + failed:
        print(f"    {line}")
    if not ok:
        FAILURES.append(f"{name}: " + "; ".join(failed))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="no GPU: TP=2 on CPU against the CPU reference")
    parser.add_argument("--only", nargs="*", default=None, choices=SECTIONS)
    parser.add_argument("--out", type=Path, default=None, help="folder for engine_gpu.{json,png}")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: run with --smoke to exercise the script on CPU")
        return 2
    device = "cpu" if args.smoke else "cuda"
    # on CPU, TP=1 would compare the reference with itself
    only = args.only if args.only is not None else (["tp2"] if args.smoke else list(SECTIONS))
    if args.smoke and "tp1" in only:
        print("--smoke runs tp2 only: tp1 on CPU is the reference itself")
        return 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="baton-engine-smoke-")) if args.smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)"
    max_tokens = SMOKE_TOKENS if args.smoke else MAX_TOKENS
    with tempfile.TemporaryDirectory(prefix="baton-engine-gpu-") as tmp:
        ckpt = save_model(Path(tmp) / "model", build_model(ModelConfig(**MODEL), seed=0))
        print(f"reference: CPU, TP=1, {len(prompts())} prompts x {max_tokens} tokens, fp32 greedy")
        ref = generate(ckpt, "cpu", 1, max_tokens)
        ROWS.append({"name": "cpu tp1 (reference)", "device": "cpu", "tp": 1, "out_tok_per_s": ref[2]})
        for section in only:
            tp = int(section[2:])
            if device == "cuda" and torch.cuda.device_count() < tp:
                print(f"  {section}: skipped, {torch.cuda.device_count()} CUDA device(s)")
                CHECKS.append({"name": f"{device} {section}", "ok": True, "skipped": "too few devices"})
                continue
            try:
                got = generate(ckpt, device, tp, max_tokens)
                compare(f"{device} {section} vs cpu tp1", ref, got)
                ROWS.append({"name": f"{device} {section}", "device": device, "tp": tp, "out_tok_per_s": got[2]})
            except Exception as e:  # a broken section must not cost the others' results (device time is scarce)
                traceback.print_exc()
                FAILURES.append(f"section {section} stopped: {type(e).__name__}: {e}")
            write(out, name, max_tokens)
    write(out, name, max_tokens)
    for row in ROWS:
        print(f"  {row['name']:<24}{row['out_tok_per_s']:>10.0f} output tokens/s")
    print(f"wrote {out / 'engine_gpu.json'} and {out / 'engine_gpu.png'}")
    print(f"\n{len(FAILURES)} failure(s)" + "".join(f"\n  {f}" for f in FAILURES))
    return 1 if FAILURES else 0


def write(out: Path, device: str, max_tokens: int) -> None:
    """Rewritten after every section, so a run stopped at its time limit still leaves what it measured."""
    result = {"device": device, "model": MODEL, "max_tokens": max_tokens, "tie": TIE}
    result |= {"checks": CHECKS, "throughput": ROWS, "failures": FAILURES}
    (out / "engine_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r["name"] for r in ROWS], [r["out_tok_per_s"] for r in ROWS], color="C0")
    ax.set(xlabel="output tokens/s (greedy, fp32)", title=f"Baton engine on {device}")
    fig.tight_layout()
    fig.savefig(out / "engine_gpu.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
