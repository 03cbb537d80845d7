"""MLA decode on CPU: one layer's attention for one new token per sequence, DeepSeek-V3's shapes with its
128 heads cut to 16 (a tensor-parallel rank's share; nope 128, rope 64, v 128, kv_lora_rank 512), at
contexts 1k-16k and batch 1 and 8, three ways:

  absorbed    the latent-only cache [blocks, 16, 512 + 64]: q_lat = q_nope @ W_UK per head, the C++ paged
              MLA kernel (kernels/mla_decode.py) over the pool, then o_lat @ W_UV^T - what Baton serves;
  cached K/V  what a model without absorption would keep instead, a per-head K [H, 192] and V [H, 128]
              per token, contiguous, attended by batched matmuls (scores in the cache dtype, softmax in
              float32: torch's fastest CPU form here; SDPA's flash kernel is slower at one query row);
              it pays in memory, 8.9x the cache bytes at 16 heads (71x at V3's 128);
  decompress  the latent cache, each step re-expanding the rows' cached latents through kv_b_proj into
              per-head K/V (the naive form a latent cache allows), then the same attention.

Each row reports ms per decode step (per layer) and the cache bytes per token of each cache. A second
table times the paged MLA kernels themselves - the C++ kernel against the dispatcher's torch path
(gather the blocks, float32 matmuls) - at 16 and 128 heads, and at the tests' small L 36 + R 8.
Timings interleave the contenders and keep each one's best of the repeats (other work on the machine
only ever adds time); the JSON records the load average. --clock cpu times by the process's CPU time
instead of the wall clock: with --threads 1, what each contender costs on its core whatever else the
machine runs (a busy machine's scheduling would otherwise dominate a 2-thread kernel's wall time).
The forms check against each other before they are timed, and so do the two kernels.

Usage: python benchmarks/mla_decode.py [--quick] [--dtype bf16|fp32] [--threads N] [--clock wall|cpu] [--out NAME]
(writes benchmarks/results/NAME.{json,png}; default name mla_decode)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch
from baton.kernels.cpu_extension import cpu_kernels
from baton.kernels.mla_decode import paged_mla_decode_cpu, paged_mla_decode_torch
from baton.serve.runner.model_runner import keep_freed_memory

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16
HEADS, NOPE, ROPE, V_DIM, LORA = 16, 128, 64, 128, 512
SCALE = (NOPE + ROPE) ** -0.5


def pool(lens: list[int], width: int, dtype: torch.dtype, rng: random.Random):
    """A pool with a spare quarter, each row's blocks scattered over it as a busy server's are."""
    need = sum(-(-n // BLOCK) for n in lens)
    num_blocks = need + need // 4 + 1
    cache = torch.randn(num_blocks, BLOCK, width, dtype=dtype)
    ids = rng.sample(range(num_blocks), need)
    tables = torch.zeros(len(lens), max(-(-n // BLOCK) for n in lens), dtype=torch.int32)
    at = 0
    for r, n in enumerate(lens):
        k = -(-n // BLOCK)
        tables[r, :k] = torch.tensor(ids[at : at + k], dtype=torch.int32)
        at += k
    return cache, tables, torch.tensor(lens, dtype=torch.int32)


CLOCK = time.perf_counter  # or time.process_time (--clock cpu)


def best_of(fns: dict, reps: int) -> dict[str, float]:
    """Milliseconds of each function, interleaved, best of reps (after one warm-up call each)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            t = CLOCK()
            fn()
            best[name] = min(best[name], (CLOCK() - t) * 1e3)
    return best


def attend(q, k, v, lens: list[int]) -> torch.Tensor:
    """softmax(q k^T * scale) v per row and head over its first lens[b] keys: q [B, H, 1, Dk], k [B, H, S, Dk]."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * SCALE
    if min(lens) < k.shape[2]:
        pos = torch.arange(k.shape[2])
        s.masked_fill_(pos >= torch.tensor(lens)[:, None, None, None], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)


def forms(batch: int, ctx: int, dtype: torch.dtype, rng: random.Random) -> dict:
    """One layer's decode attention three ways; returns the timings (and checks they agree)."""
    lens = [ctx] * batch
    kv_b_proj = torch.randn(HEADS * (NOPE + V_DIM), LORA, dtype=dtype) * LORA**-0.5
    w_uk, w_uv = kv_b_proj.view(HEADS, NOPE + V_DIM, LORA).split([NOPE, V_DIM], dim=1)
    w_uk, w_uv_t = w_uk.contiguous(), w_uv.transpose(1, 2).contiguous()  # [H, nope, L], [H, L, v]
    q_nope = torch.randn(batch, HEADS, NOPE, dtype=dtype)
    q_pe = torch.randn(batch, HEADS, ROPE, dtype=dtype)
    cache, tables, ctx_lens = pool(lens, LORA + ROPE, dtype, rng)

    def absorbed():
        q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe], -1)
        o = paged_mla_decode_cpu(q, cache, tables, ctx_lens, SCALE, LORA)
        return torch.bmm(o.transpose(0, 1), w_uv_t).transpose(0, 1)

    def gather_rows() -> torch.Tensor:  # [B, S, L + R]: the rows' cached latents and rope keys
        blocks = torch.index_select(cache, 0, tables.flatten().long())
        return blocks.view(batch, -1, LORA + ROPE)[:, :ctx]

    def decompressed_kv(rows):
        kv = torch.matmul(rows[..., :LORA], kv_b_proj.T).view(batch, ctx, HEADS, NOPE + V_DIM)
        k_pe = rows[..., None, LORA:].expand(batch, ctx, HEADS, ROPE)
        k = torch.cat([kv[..., :NOPE], k_pe], -1).transpose(1, 2)  # [B, H, S, nope + rope]
        return k, kv[..., NOPE:].transpose(1, 2)

    q_full = torch.cat([q_nope, q_pe], -1)[:, :, None]  # [B, H, 1, nope + rope]
    k_cached, v_cached = (t.contiguous() for t in decompressed_kv(gather_rows()))  # the per-head cache

    def cached():
        return attend(q_full, k_cached, v_cached, lens)[:, :, 0]

    def decompress():
        return attend(q_full, *decompressed_kv(gather_rows()), lens)[:, :, 0]

    want = cached().float()
    for name, fn in (("absorbed", absorbed), ("decompress", decompress)):
        err = ((fn().float() - want).abs().max() / want.abs().max()).item()
        assert err < (1e-4 if dtype == torch.float32 else 5e-2), f"{name} differs from cached K/V by {err:.1e}"
    del want
    reps = 3 if batch * ctx >= 32768 else 8
    return best_of({"absorbed": absorbed, "cached_kv": cached, "decompress": decompress}, reps)


def kernel_row(heads, batch, ctx, dtype, rng, lora=LORA, rope=ROPE) -> dict:
    cache, tables, lens = pool([ctx] * batch, lora + rope, dtype, rng)
    q = torch.randn(batch, heads, lora + rope, dtype=dtype)
    args = (q, cache, tables, lens, SCALE, lora)
    got, want = paged_mla_decode_cpu(*args).float(), paged_mla_decode_torch(*args).float()
    assert ((got - want).abs().max() / want.abs().max()).item() < (1e-5 if dtype == torch.float32 else 2e-2)
    reps = 4 if batch * ctx * heads >= 2**20 else 12
    t = best_of({"cpp": lambda: paged_mla_decode_cpu(*args), "torch": lambda: paged_mla_decode_torch(*args)}, reps)
    flops = 2 * batch * ctx * heads * (2 * lora + rope)
    return {
        "heads": heads,
        "kv_lora_rank": lora,
        "qk_rope": rope,
        "batch": batch,
        "context": ctx,
        "cpp_ms": t["cpp"],
        "torch_ms": t["torch"],
        "speedup": t["torch"] / t["cpp"],
        "cpp_gflops": flops / t["cpp"] / 1e6,
        "cpp_gbs": batch * ctx * (lora + rope) * dtype.itemsize / t["cpp"] / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="contexts 1k and 4k only")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights, queries and caches")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time")
    ap.add_argument("--out", default="mla_decode", help="results file name, without suffix")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    keep_freed_memory()  # as the serving runner does: the torch paths' gathers would page-fault otherwise
    torch.manual_seed(0)
    rng = random.Random(0)
    contexts = (1024, 4096) if args.quick else (1024, 2048, 4096, 8192, 16384)
    load_before = os.getloadavg()[0]
    elem = dtype.itemsize
    bytes_per_token = {
        "latent": (LORA + ROPE) * elem,
        "per_head_kv_16_heads": HEADS * (NOPE + ROPE + V_DIM) * elem,
        "per_head_kv_128_heads": 128 * (NOPE + ROPE + V_DIM) * elem,
    }
    print(f"cache bytes per token per layer ({args.dtype}): {bytes_per_token}")
    rows = []
    for batch in (1, 8):
        for ctx in contexts:
            t = forms(batch, ctx, dtype, rng)
            rows.append({"batch": batch, "context": ctx, **{f"{k}_ms": v for k, v in t.items()}})
            print(
                f"b{batch} ctx {ctx:>5}: absorbed {t['absorbed']:8.3f} ms  cached K/V {t['cached_kv']:8.3f} ms "
                f"({t['cached_kv'] / t['absorbed']:5.2f}x)  decompress {t['decompress']:9.2f} ms "
                f"({t['decompress'] / t['absorbed']:6.1f}x)",
                flush=True,
            )
    kernel = []
    shapes = [(h, b, c, LORA, ROPE) for h in (16, 128) for b, c in ((1, 1024), (1, 4096), (1, 16384), (8, 4096))]
    shapes += [(16, 4, 100, 36, 8), (4, 16, 200, 36, 8)]  # the tests' odd small dims (a tiny model's decode)
    for heads, batch, ctx, lora, rope in shapes:
        r = kernel_row(heads, batch, ctx, dtype, rng, lora, rope)
        kernel.append(r)
        print(
            f"kernel H{heads:<3} L{lora:<3} R{rope:<2} b{batch:<2} ctx {ctx:>5}: C++ {r['cpp_ms']:8.3f} ms "
            f"({r['cpp_gflops']:5.0f} GFLOP/s, {r['cpp_gbs']:5.1f} GB/s)  torch {r['torch_ms']:8.3f} ms  "
            f"{r['speedup']:5.2f}x",
            flush=True,
        )
    out = {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "mla_path": cpu_kernels().mla_decode_path(dtype),
        "shapes": {"heads": HEADS, "qk_nope": NOPE, "qk_rope": ROPE, "v_head_dim": V_DIM, "kv_lora_rank": LORA},
        "block_size": BLOCK,
        "load_average": [load_before, os.getloadavg()[0]],
        "cache_bytes_per_token_per_layer": bytes_per_token,
        "forms": rows,
        "kernel": kernel,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(out, RESULTS / f"{args.out}.png")
    print(f"wrote {RESULTS / args.out}.json and .png; load average {out['load_average']}")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for batch, style in ((1, "-"), (8, "--")):
        sel = [r for r in out["forms"] if r["batch"] == batch]
        for key, label, colour in (
            ("absorbed_ms", "absorbed (latent cache)", "C0"),
            ("cached_kv_ms", "per-head K/V cache", "C1"),
            ("decompress_ms", "latent cache, decompress", "C2"),
        ):
            a.plot(
                [r["context"] for r in sel],
                [r[key] for r in sel],
                style,
                color=colour,
                marker="o",
                label=f"{label}, batch {batch}",
            )
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("context (tokens)")
    a.set_ylabel("ms per decode step, one layer")
    bpt = out["cache_bytes_per_token_per_layer"]
    a.set_title(
        f"MLA decode, {out['dtype']}, {out['shapes']['heads']} heads: cache "
        f"{bpt['latent']} vs {bpt['per_head_kv_16_heads']} B/token"
    )
    a.legend(fontsize=7)
    rows = out["kernel"]
    b.bar(range(len(rows)), [r["speedup"] for r in rows], color=["C0" if r["heads"] == 16 else "C3" for r in rows])
    b.set_xticks(
        range(len(rows)),
        [f"H{r['heads']} L{r['kv_lora_rank']}\nb{r['batch']} {r['context']}" for r in rows],
        fontsize=7,
    )
    b.axhline(1.0, color="k", lw=0.8)
    b.set_ylabel("C++ kernel speed-up over the torch path")
    threads = f"{out['threads']} thread" + ("s" if out["threads"] > 1 else "")
    b.set_title(f"paged MLA kernel ({out['mla_path']}, {threads}, {out['clock']} clock)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
