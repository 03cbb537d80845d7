"""Training on CUDA, for a session that is lent a GPU: every backend's bf16 steps against CPU fp32
losses, Baton's Triton FlashAttention against SDPA, and MFU against the device's peak.

    python benchmarks/train_gpu.py            # on a GPU (estimated 3-4 minutes on one H200: not yet run on one)
    python benchmarks/train_gpu.py --smoke    # no GPU: tiny model on the CPU (tests/benchmarks)

Through the device tool, one call (`baton train` needs Baton's training dependencies - deepspeed,
datasets, tokenizers, safetensors, pyyaml, tqdm - beside the image's torch and triton; the script
exits naming any that are missing, before any work; the device machine has no network, so they
must already be in its image or be carried there):

    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . && \
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/train_gpu.py --out $OUT 2>&1 | tee $OUT/log.txt

1. Backends. `baton train`'s Trainer runs STEPS steps of one small model on the embedded corpus in
   bf16 for: plain torch, DeepSpeed ZeRO-0/1/2/3, torch3d (its one-rank layout: model placement,
   autocast and the on-device gradient norm), compile: true, attention: triton, and - with two or
   more GPUs - DDP, ZeRO-2/3, FSDP2, TP=2 and PP=2 on two ranks (torchrun, NCCL). NCCL needs one GPU
   per rank, so on one GPU only the one-rank layouts run (the JSON says which). Each loss curve is
   held to a CPU fp32 run of the same recipe (CUDA hidden) within 2^-6 relative: bf16 keeps 8
   significant bits, so one rounding of the loss is 2^-9, the precision tests hold bf16 backends
   to 2^-7 of fp32 over 20 steps of a tinier model; a GPU's different kernels and reduction orders
   (cuBLAS, fused SDPA) add their own rounding, so two more bits of slack. A backend that places a
   tensor on the wrong device fails here outright (NCCL rejects CPU tensors; ops refuse mixed devices).
2. Attention. TritonFlashAttention (kernels/flash_attention*.py through baton.train.attention)
   against torch SDPA in bf16 and fp16: output and dq/dk/dv, as max |err| / max |ref| with SDPA in
   fp32 as the reference, for both; the Triton kernels may not be worse than SDPA's own error by
   more than 2x + 1e-3 (kernels_gpu.py's bar is a flat 5e-2).
3. MFU. A ~350M-parameter model, bf16, the trainer's MFU (baton.train.metrics.peak_flops: the
   datasheet table for a known GPU) for sdpa, triton and compile.

Writes OUT/train_gpu.json (OUT: --out, default benchmarks/results; smoke: a temporary folder).
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:  # the Triton kernels run under the interpreter on CPU tensors (exact in fp32 only)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LOSS_RTOL = 2**-6
STEPS = 3 if SMOKE else 8
SMALL = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8}
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
LARGE = {"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 12, "num_attention_heads": 12}
DS = ["backend=deepspeed"]
NEEDS = ("deepspeed", "datasets", "tokenizers", "safetensors", "yaml", "tqdm")  # what `baton train` imports
ONE_RANK = {
    "torch": [],
    **{f"zero{s}": [*DS, f"deepspeed.stage={s}"] for s in range(4)},
    "torch3d": ["backend=torch3d"],
    "compile": ["compile=true"],
    "triton": ["attention=triton"],
}
TWO_RANKS = {
    "ddp": [],
    "zero2": [*DS, "deepspeed.stage=2"],
    "zero3": [*DS, "deepspeed.stage=3"],
    "fsdp2": ["backend=torch3d", "parallel.dp=2"],
    "tp2": ["backend=torch3d", "parallel.tp=2"],
    "pp2": ["backend=torch3d", "parallel.pp=2"],
}
if SMOKE:  # DeepSpeed's start-up costs seconds a run on a CPU: one stage is enough to keep the wiring honest
    ONE_RANK = {k: v for k, v in ONE_RANK.items() if k in ("torch", "zero2", "torch3d", "triton")}


def recipe(model: dict, seq: int, micro: int, out: Path) -> dict:
    return {
        "model": {**model, "max_position_embeddings": seq},
        "data": {"seq_len": seq, "val_fraction": 0.05, "cache_dir": str(out / "datasets")},
        "tokenizer": {"kind": "char"},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2},
        "micro_batch_size": micro,
        "global_batch_size": micro * 2,
        "eval_interval": 0,
        "eval_batches": 1,
        "log_interval": 1,
        "export": False,
        "checkpoint": {"resume": "never"},
        "logging": {"progress": False, "mfu": True, "plot": False, "tensorboard": False},
    }


def worker(job: Path) -> None:
    """Every run of one launch (a lone process, or each rank under torchrun), one after another."""
    from baton.train.recipe import config_from_dict
    from baton.train.distributed import init_distributed
    from baton.train.trainer import train

    spec = json.loads(job.read_text())
    dist = init_distributed(need_group=True)
    out = {}
    for name, overrides in spec["runs"].items():
        run_dir = Path(spec["root"]) / name
        t0 = time.perf_counter()
        try:
            train(config_from_dict(spec["recipe"], [*overrides, f"out_dir={run_dir}", f"max_steps={spec['steps']}"]))
        except Exception as e:  # noqa: BLE001  (one backend failing must not hide the others' results)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        if dist.is_main:
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            out[name] = {
                "losses": [r["loss"] for r in records],
                "mfu": records[-1]["mfu"],
                "tokens_per_s": records[-1]["tokens_per_s"],
                "wall_s": time.perf_counter() - t0,
            }
    if dist.is_main:
        job.with_suffix(".out.json").write_text(json.dumps(out))


def launch(runs: dict, recipe_: dict, steps: int, root: Path, nproc: int = 1, env: dict | None = None) -> dict:
    job = root / f"job-{len(list(root.glob('job-*.json')))}.json"
    job.write_text(json.dumps({"runs": runs, "recipe": recipe_, "steps": steps, "root": str(root / job.stem)}))
    me = [str(Path(__file__).resolve()), "--worker", str(job), *(["--smoke"] if SMOKE else [])]
    from baton.train.distributed import free_port

    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
    ]
    cmd = [*torchrun, *me] if nproc > 1 else [sys.executable, *me]
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode != 0 or not job.with_suffix(".out.json").is_file():
        return {name: {"error": (proc.stdout + proc.stderr)[-3000:]} for name in runs}
    return json.loads(job.with_suffix(".out.json").read_text())


def check_losses(results: dict, reference: list[float], checks: list[dict]) -> None:
    for name, rec in results.items():
        if "error" in rec:
            checks.append({"name": f"losses {name}", "ok": False, "error": rec["error"]})
            print(f"  check losses {name:10s} FAIL: {rec['error'][-400:]}")
            continue
        rel = max(abs(a - b) / abs(b) for a, b in zip(rec["losses"], reference))
        ok = len(rec["losses"]) == len(reference) and rel <= LOSS_RTOL and all(map(math.isfinite, rec["losses"]))
        checks.append({"name": f"losses {name}", "ok": ok, "max_rel_err": rel, "mfu": rec["mfu"]})
        print(
            f"  check losses {name:10s} max rel err {rel:.2e} (<= {LOSS_RTOL:.1e})  mfu {rec['mfu']}  {'ok' if ok else 'FAIL'}"
        )


def attention_checks(checks: list[dict], device: torch.device) -> None:
    """Triton FlashAttention vs SDPA, both against fp32 SDPA, forward and backward."""
    import types

    from baton.common.model import DenseCausalAttention
    from baton.train.attention import TritonFlashAttention

    b, s, hq, hkv, d = (2, 40, 4, 2, 16) if SMOKE else (4, 1024, 16, 4, 128)
    dtypes = [torch.float32] if SMOKE else [torch.bfloat16, torch.float16]
    g = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(b, s, h, d, device=device, generator=g) for h in (hq, hkv, hkv, hq)]
    for window in (None, 256 if not SMOKE else 7):
        layer = types.SimpleNamespace(scaling=d**-0.5, sliding_window=window, layer_idx=0)

        def run(core, dtype):
            q, k, v = (t.to(dtype).detach().clone().requires_grad_() for t in base[:3])  # fresh leaves per run
            out = core(q, k, v, layer)
            out.backward(base[3].to(dtype))
            return [t.detach().float().clone() for t in (out, q.grad, k.grad, v.grad)]

        ref = run(DenseCausalAttention(), torch.float32)
        for dtype in dtypes:
            tri, sdpa = run(TritonFlashAttention(), dtype), run(DenseCausalAttention(), dtype)
            for name, t, s_, r in zip(("out", "dq", "dk", "dv"), tri, sdpa, ref):
                scale = r.abs().max().item()
                err_t, err_s = (t - r).abs().max().item() / scale, (s_ - r).abs().max().item() / scale
                ok = err_t <= 2 * err_s + 1e-3
                label = f"triton {name} {str(dtype).removeprefix('torch.')} window={window}"
                checks.append({"name": label, "ok": ok, "rel_err": err_t, "sdpa_rel_err": err_s})
                print(f"  check {label:34s} rel err {err_t:.2e} (sdpa {err_s:.2e})  {'ok' if ok else 'FAIL'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    cuda = torch.cuda.is_available() and not SMOKE
    if not cuda and not SMOKE:
        sys.exit("no CUDA device: run with --smoke on a CPU")
    import importlib.util

    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:  # the device image may lack Baton's training dependencies; say which instead of failing per run
        sys.exit(f"missing Python packages {missing}: install Baton with its dependencies (pip install .)")
    out = args.out or (Path(tempfile.mkdtemp(prefix="train_gpu_")) if SMOKE else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="train_gpu_runs_"))
    from baton.train.metrics import peak_flops

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    gpus = torch.cuda.device_count() if cuda else 0
    summary: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (smoke)",
        "gpus": gpus,
        "torch": torch.__version__,
        "steps": STEPS,
        "loss_rtol": LOSS_RTOL,
        "two_rank_layouts": "run" if gpus >= 2 else "skipped: NCCL needs one GPU per rank, this machine has < 2",
    }
    if cuda:
        summary["peak_bf16_flops"], summary["peak_source"] = peak_flops(device, torch.bfloat16)
    checks: list[dict] = []
    t0 = time.perf_counter()
    small = recipe(TINY if SMOKE else SMALL, 32 if SMOKE else 256, 2 if SMOKE else 8, root)
    precision = "fp32" if SMOKE else "bf16"  # smoke: the interpreter is exact in fp32 only
    print("== backends: losses against CPU fp32", flush=True)
    ref = launch({"cpu_fp32": []}, small, STEPS, root, env={"CUDA_VISIBLE_DEVICES": ""})["cpu_fp32"]
    if "error" in ref:
        sys.exit(f"the CPU fp32 reference failed:\n{ref['error']}")
    summary["reference_losses"] = ref["losses"]
    runs = {name: [*o, f"precision={precision}"] for name, o in ONE_RANK.items()}
    results = launch(runs, small, STEPS, root)
    if gpus >= 2:
        two = launch({f"{k}-2": [*o, f"precision={precision}"] for k, o in TWO_RANKS.items()}, small, STEPS, root, 2)
        results.update(two)
    check_losses(results, ref["losses"], checks)
    summary["backends"] = results
    print("== attention: Triton FlashAttention against SDPA", flush=True)
    attention_checks(checks, device)
    print("== MFU", flush=True)
    large = recipe(TINY if SMOKE else LARGE, 32 if SMOKE else 2048, 2 if SMOKE else 8, root)
    mfu_runs = {"sdpa": [], "triton": ["attention=triton"], "compile": ["compile=true"]}
    if SMOKE:  # the interpreter and a CPU compile would only repeat section 1's wiring, slowly
        mfu_runs = {"sdpa": []}
    mfu = launch({k: [*o, f"precision={precision}"] for k, o in mfu_runs.items()}, large, STEPS + 2, root)
    for name, rec in mfu.items():
        ok = "error" not in rec and rec["mfu"] is not None and rec["mfu"] > 0
        checks.append({"name": f"mfu {name}", "ok": ok, **{k: rec.get(k) for k in ("mfu", "tokens_per_s", "error")}})
        print(f"  mfu {name:8s} {rec.get('mfu')}  tokens/s {rec.get('tokens_per_s')}  {'ok' if ok else 'FAIL'}")
    summary["mfu"] = mfu
    summary["checks"], summary["wall_s"] = checks, time.perf_counter() - t0
    (out / "train_gpu.json").write_text(json.dumps(summary, indent=2) + "\n")
    failures = [c["name"] for c in checks if not c["ok"]]
    print(f"{len(checks)} checks, {len(failures)} failure(s) {failures or ''}; {summary['wall_s']:.0f}s; wrote {out}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
