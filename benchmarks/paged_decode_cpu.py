"""CPU paged decode attention: the C++ kernel (reads the pools in place) against the torch path
(gather rows of similar length, then SDPA), over batch sizes and context-length mixes, with the
bytes of K/V each call must read turned into an effective bandwidth next to a measured copy ceiling.

Usage: python benchmarks/paged_decode_cpu.py [--quick] [--dtype bf16] [--out NAME]
(writes benchmarks/results/NAME.{json,png}, default paged_decode_cpu; the JSON names the kernel's
vector path: avx512, avx2 or portable)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from baton.kernels.cpu_extension import cpu_kernels
from baton.kernels.paged_attention import paged_attention_decode_cpu, paged_attention_decode_torch
from baton.kernels.reference import paged_attention_decode_ref
from baton.serve.runner.model_runner import keep_freed_memory

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16


def lengths(mix: str, batch: int, rng: random.Random) -> list[int]:
    if mix == "mixed":  # log-normal, like the serving benchmark's prompts + outputs
        return [min(4096, max(1, int(rng.lognormvariate(4.6, 0.9)))) for _ in range(batch)]
    if mix == "30-220":  # the serving benchmark's decode contexts (prompts 16-160 + outputs 8-64)
        return [rng.randint(30, 220) for _ in range(batch)]
    return [int(mix)] * batch


def case(heads: tuple[int, int], head_dim: int, lens: list[int], rng: random.Random):
    """Pools bigger than the cache (512 MiB each), blocks scattered over them as a busy server's are."""
    hq, hkv = heads
    need = sum(-(-n // BLOCK) for n in lens)
    num_blocks = max(need, 512 * 2**20 // (BLOCK * hkv * head_dim * 4))
    k_cache = torch.randn(num_blocks, BLOCK, hkv, head_dim)
    v_cache = torch.randn_like(k_cache)
    ids = rng.sample(range(num_blocks), need)
    width = max(-(-n // BLOCK) for n in lens)
    tables, at = torch.zeros(len(lens), width, dtype=torch.int32), 0
    for r, n in enumerate(lens):
        nb = -(-n // BLOCK)
        tables[r, :nb] = torch.tensor(ids[at : at + nb], dtype=torch.int32)
        at += nb
    return torch.randn(len(lens), hq, head_dim), k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def timed(fn, args, reps: int) -> float:
    fn(*args)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_ceiling_gbs() -> float:
    x = torch.randn(64 * 2**20)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / timed(lambda: y.copy_(x), (), 10) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="queries and pools")
    ap.add_argument("--out", default="paged_decode_cpu", help="results file name, without suffix")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    keep_freed_memory()  # as the serving runner does: otherwise the torch path page-faults its gathers
    rng = random.Random(0)
    ceiling = copy_ceiling_gbs()
    batches = (1, 16, 64) if args.quick else (1, 4, 16, 64, 256)
    mixes = ("30-220", "mixed", "512") if args.quick else ("30-220", "64", "512", "2048", "mixed")
    rows = []
    for heads, head_dim in (((8, 2), 64), ((8, 4), 32), ((32, 8), 128)):  # 25M model; char model; 7B-like
        for mix in mixes:
            for batch in batches:
                lens = lengths(mix, batch, rng)
                c = case(heads, head_dim, lens, rng)
                c = (*(t.to(dtype) for t in c[:3]), *c[3:])
                want = paged_attention_decode_ref(*(t.float() for t in c[:3]), *c[3:]) if batch <= 16 else None
                got = paged_attention_decode_cpu(*c)
                if want is not None:
                    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 2**-8}
                    torch.testing.assert_close(got.float(), want, **tol)
                reps = 5 if args.quick else 20
                t_cpp = timed(paged_attention_decode_cpu, c, reps)
                t_torch = timed(paged_attention_decode_torch, c, reps)
                kv_bytes = 2 * sum(lens) * heads[1] * head_dim * dtype.itemsize
                rows.append(
                    {
                        "heads": f"{heads[0]}/{heads[1]}",
                        "head_dim": head_dim,
                        "lengths": mix,
                        "batch": batch,
                        "tokens": sum(lens),
                        "cpp_ms": t_cpp * 1e3,
                        "torch_ms": t_torch * 1e3,
                        "speedup": t_torch / t_cpp,
                        "cpp_gbs": kv_bytes / t_cpp / 1e9,
                        "torch_gbs": kv_bytes / t_torch / 1e9,
                    }
                )
                r = rows[-1]
                print(
                    f"{r['heads']:>5} D{head_dim:<3} {mix:>6} b{batch:<4} C++ {r['cpp_ms']:8.3f} ms "
                    f"({r['cpp_gbs']:5.1f} GB/s)  torch {r['torch_ms']:8.3f} ms ({r['torch_gbs']:5.1f} GB/s)  "
                    f"{r['speedup']:5.2f}x",
                    flush=True,
                )
    print(f"copy ceiling (read + write): {ceiling:.1f} GB/s; {torch.get_num_threads()} threads")
    RESULTS.mkdir(exist_ok=True)
    out = {
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "vector_path": cpu_kernels().paged_decode_simd(),
        "copy_ceiling_gbs": ceiling,
        "block_size": BLOCK,
        "rows": rows,
    }
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(rows, RESULTS / f"{args.out}.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["heads"], r["head_dim"]) for r in rows})
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4), squeeze=False)
    for ax, (heads, dim) in zip(axes[0], configs):
        for mix in dict.fromkeys(r["lengths"] for r in rows):
            sel = [r for r in rows if (r["heads"], r["head_dim"], r["lengths"]) == (heads, dim, mix)]
            ax.plot([r["batch"] for r in sel], [r["speedup"] for r in sel], marker="o", label=f"lengths {mix}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("C++ kernel speedup over torch path")
        ax.set_title(f"heads {heads}, head_dim {dim}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
