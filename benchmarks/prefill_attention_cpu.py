"""CPU prefill attention of one serving step: torch SDPA chunk by chunk (the path before cda65b1) against
the C++ paged-decode kernel over every chunk token as a decode row (serve/runner/attention.py's
`rows_over_cache`: once a chunk's K/V are in the pools, its token i is a decode row over prefix + i + 1
cached tokens), on the serving benchmark's step: 2,048 prompt tokens of 16-160-token prompts
(serve_vs_vllm's mix), or the same chunks continuing 0-512-token cached prefixes (chunked prefill).
Both are checked against the torch reference before timing.

Usage: python benchmarks/prefill_attention_cpu.py [--quick] [--out NAME] [--dir DIR]
(writes DIR/NAME.{json,png}, default benchmarks/results/prefill_attention_cpu)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from baton.kernels import reshape_and_cache
from baton.kernels.flash_attention import flash_attn_with_paged_prefix_torch
from baton.kernels.paged_attention import paged_attention_decode_cpu
from baton.kernels.reference import flash_attn_with_paged_prefix_ref
from baton.serve.runner.attention import AttentionMetadata

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK, DIM, TOKENS = 16, 64, 2048
SHAPES = {"25M (8/2)": (8, 2), "110M (16/4)": (16, 4)}


def step(heads: tuple[int, int], dtype: torch.dtype, prefixes: bool, rng: random.Random):
    """q/k/v of one step's chunks, pools holding each chunk's prefix and then its new K/V, metadata."""
    hq, hkv = heads
    chunks = []
    while sum(n for _, n in chunks) < TOKENS:
        n = min(rng.randint(16, 160), TOKENS - sum(n for _, n in chunks))
        chunks.append((rng.randint(0, 512) if prefixes else 0, n))
    need = [-(-(p + n) // BLOCK) for p, n in chunks]
    blocks = torch.randperm(4 * sum(need), generator=torch.Generator().manual_seed(0))[: sum(need)] + 1
    tables, at = [], 0
    for k in need:
        tables.append(blocks[at : at + k].tolist())
        at += k
    width = max(need)
    pools = [torch.randn(4 * sum(need) + 1, BLOCK, hkv, DIM).to(dtype) for _ in range(2)]
    slots = [t[pos // BLOCK] * BLOCK + pos % BLOCK for t, (p, n) in zip(tables, chunks) for pos in range(p, p + n)]
    q, k, v = (torch.randn(TOKENS, h, DIM).to(dtype) for h in (hq, hkv, hkv))
    reshape_and_cache(k, v, pools[0], pools[1], torch.tensor(slots))
    cu = [0]
    for _, n in chunks:
        cu.append(cu[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=0,
        decode_block_tables=torch.zeros(0, width, dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        prefill_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        prefill_prefix_lens=torch.tensor([p for p, _ in chunks], dtype=torch.int32),
        max_prefill_len=max(n for _, n in chunks),
    )
    return (q, k, v), pools, md, chunks


def best_of(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="prefill_attention_cpu", help="results file name, without suffix")
    ap.add_argument("--dir", type=Path, default=RESULTS, help="results folder")
    args = ap.parse_args()
    reps, rows = (3 if args.quick else 10), []
    for shape, heads in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            for prefixes in (False, True):
                (q, k, v), (kc, vc), md, chunks = step(heads, dtype, prefixes, random.Random(0))
                scale = DIM**-0.5
                old_args = (q, k, v, md.prefill_cu_seqlens, kc, vc, md.prefill_block_tables)
                old_args += (md.prefill_prefix_lens, md.max_prefill_len)
                tables, lens = md.rows_over_cache

                def sdpa():
                    return flash_attn_with_paged_prefix_torch(*old_args, causal=True, softmax_scale=scale)

                def kernel():
                    return paged_attention_decode_cpu(q, kc, vc, tables, lens, softmax_scale=scale)

                want = flash_attn_with_paged_prefix_ref(*old_args, causal=True, softmax_scale=scale).float()
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                err = {n: (f().float() - want).abs().max().item() for n, f in (("sdpa", sdpa), ("kernel", kernel))}
                assert max(err.values()) < tol, f"{shape} {dtype}: off the reference by {err}"
                flops = sum(4 * heads[0] * DIM * n * (p + (n + 1) / 2) for p, n in chunks)
                t_old, t_new = best_of(sdpa, reps), best_of(kernel, reps)
                row = {
                    "shape": shape,
                    "dtype": str(dtype).split(".")[1],
                    "prefixes": "0-512 cached" if prefixes else "none",
                    "chunks": len(chunks),
                    "sdpa_ms": t_old * 1e3,
                    "kernel_ms": t_new * 1e3,
                    "speedup": t_old / t_new,
                    "kernel_gflops": flops / t_new / 1e9,
                    "max_err": err,
                }
                rows.append(row)
                print(
                    f"{shape:12s} {row['dtype']:8s} prefixes {row['prefixes']:12s} {len(chunks)} chunks: "
                    f"SDPA {row['sdpa_ms']:6.2f} ms, kernel {row['kernel_ms']:6.2f} ms ({row['speedup']:.1f}x, "
                    f"{row['kernel_gflops']:.0f} GFLOP/s)",
                    flush=True,
                )
    args.dir.mkdir(parents=True, exist_ok=True)
    meta = {"threads": torch.get_num_threads(), "tokens_per_step": TOKENS, "block_size": BLOCK, "head_dim": DIM}
    (args.dir / f"{args.out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.dir / f"{args.out}.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\n{r['dtype']}, prefix {r['prefixes']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.bar([i - 0.2 for i in x], [r["sdpa_ms"] for r in rows], 0.4, label="torch SDPA per chunk")
    ax.bar([i + 0.2 for i in x], [r["kernel_ms"] for r in rows], 0.4, label="C++ decode kernel, a row per token")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("ms per layer, one 2,048-token step")
    ax.set_title("CPU prefill attention of one serving step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
