"""Check the paged MLA decode Triton kernel (kernels/mla_decode.py) against its reference on CUDA, then time it.

    python benchmarks/mla_gpu.py            # on a GPU: checks (fp16 + bf16, fp32 for absorbed = naive), timings (bf16)
    python benchmarks/mla_gpu.py --smoke    # no GPU: tiny shapes under the Triton interpreter

Through the device tool (its image has torch and triton but not Baton; nothing to fetch there), one call:

    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . && \
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/mla_gpu.py --out $OUT 2>&1 | tee $OUT/log.txt

Checks: the kernel (split-K with its reduce, one split writing directly, 16 and 128 heads, DeepSeek-V3's
L 512 + R 64 on pages of 16 and 64 tokens, odd L 36 + R 8 over 20 heads, ragged rows from 0 to 5000
tokens) against the reference on the same values in float32; the dispatcher's CUDA branch; the cache
write; and absorbed = naive in float32 (per-head K/V decompressed by a random kv_b_proj, plain softmax
attention). Timings: medians of CUDA-event-timed runs after warm-up, as GB/s of latent read and TFLOP/s
(each a share of the ceilings measured at start-up: a large device copy, a large bf16 cuBLAS matmul),
against the dispatcher's torch path (gather + float32 matmuls) and against the naive form's cache - a
per-head K/V cache (K 192, V 128 zero-padded to 192) read by the paged decode kernel - where it fits in
8 GiB. Writes OUT/mla_gpu.{json,png} (OUT: --out, default benchmarks/results; a temporary folder in
smoke mode, whose timings mean nothing). Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the kernels' import: @triton.jit reads it when decorating
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.kernels import mla_decode as md  # noqa: E402
from baton.kernels import paged_attention as pa  # noqa: E402
from baton.kernels import reference as ref  # noqa: E402
from gpu_timing import median_ms  # noqa: E402  (the script dir is on sys.path)

DEV = torch.device("cuda" if torch.cuda.is_available() and not SMOKE else "cpu")
TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-4}  # max |err| / max |ref|
RESULTS = Path(__file__).resolve().parent / "results"
NOPE, ROPE, V_DIM, LORA = 128, 64, 128, 512  # DeepSeek-V3's attention dims
FAILURES: list[str] = []
CHECKS: list[dict] = []
ROWS: list[dict] = []


def size(gpu, smoke):
    return smoke if SMOKE else gpu


def timeit(fn, iters: int = 20) -> float:
    """Median milliseconds of fn() (CUDA events on GPU, wall clock in smoke mode)."""
    return median_ms(fn, DEV, size(iters, 1))


def check(name: str, got, want, tol: float) -> None:
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()
    ok = err <= tol
    if not ok:
        FAILURES.append(f"{name}: relative error {err:.2e}")
    CHECKS.append({"name": name, "rel_err": err, "tol": tol, "ok": ok})
    print(f"  check {name:<58} rel err {err:9.2e}  {'ok' if ok else 'FAIL'}")


def latent_pool(lens, width, dtype, block_size=16, heads_kv=None):
    """A pool [blocks, block_size, width] (or [.., heads_kv, width]) with each row's blocks scattered."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 1
    shape = (num_blocks, block_size, width) if heads_kv is None else (num_blocks, block_size, heads_kv, width)
    cache = torch.randn(shape, device=DEV, dtype=dtype)
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    tables = torch.zeros(len(lens), max(max(need), 1), dtype=torch.int32, device=DEV)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at : at + n]
        at += n
    return cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEV)


def checks() -> None:
    print("checks: Triton paged MLA decode vs the float32 reference, cache write, dispatch, absorbed = naive")
    lens = size([0, 1, 17, 1000, 5000], [0, 1, 17, 70])
    shapes = size([(16, 512, 64, 16), (128, 512, 64, 64), (20, 36, 8, 16)], [(20, 36, 8, 16)])
    for dt in size([torch.float16, torch.bfloat16], [torch.float16]):
        for heads, lora, rope, block_size in shapes:
            cache, tables, ctx = latent_pool(lens, lora + rope, dt, block_size)
            q = torch.randn(len(lens), heads, lora + rope, device=DEV, dtype=dt)
            scale = (lora + rope) ** -0.5
            want = ref.paged_mla_decode_ref(q.float(), cache.float(), tables, ctx, scale, lora)
            for splits in (None, 1, 5):
                got = md.paged_mla_decode_triton(q, cache, tables, ctx, scale, lora, num_splits=splits)
                check(f"mla decode {dt} H{heads} L{lora} R{rope} page{block_size} splits={splits}", got, want, TOL[dt])
            if DEV.type == "cuda":  # the public dispatcher takes the Triton kernel on CUDA
                got = md.paged_mla_decode(q, cache, tables, ctx, scale, lora, max_context_len=max(lens))
                check(f"paged_mla_decode dispatch {dt} H{heads}", got, want, TOL[dt])
        latent, k_pe = torch.randn(64, 512, device=DEV, dtype=dt), torch.randn(64, 64, device=DEV, dtype=dt)
        cache, _, _ = latent_pool([1024], 576, dt)
        slots = torch.randperm(cache.shape[0] * 16, device=DEV)[:64]
        slots[::7] = -1
        got, want = cache.clone(), cache.clone()
        md.mla_cache_write_triton(latent, k_pe, got, slots)
        ref.mla_cache_write_ref(latent, k_pe, want, slots)
        check(f"mla_cache_write {dt}", got, want, 0.0)

    heads, lens = size(16, 4), size([1, 300, 2000], [1, 40])
    kv_b_proj = torch.randn(heads * (NOPE + V_DIM), LORA, device=DEV) * LORA**-0.5
    w_uk, w_uv = kv_b_proj.view(heads, NOPE + V_DIM, LORA).split([NOPE, V_DIM], dim=1)
    q_nope = torch.randn(len(lens), heads, NOPE, device=DEV)
    q_pe = torch.randn(len(lens), heads, ROPE, device=DEV)
    cache, tables, ctx = latent_pool(lens, LORA + ROPE, torch.float32)
    scale = (NOPE + ROPE) ** -0.5
    naive = []
    for t, n in enumerate(lens):
        rows = ref.gather_paged(cache, tables[t], n)  # [n, L + R]
        k_nope = torch.einsum("hdl,sl->shd", w_uk, rows[:, :LORA])
        k = torch.cat([k_nope, rows[:, None, LORA:].expand(n, heads, ROPE)], -1)
        v = torch.einsum("hdl,sl->shd", w_uv, rows[:, :LORA])
        p = torch.softmax(torch.einsum("hd,shd->hs", torch.cat([q_nope[t], q_pe[t]], -1), k) * scale, -1)
        naive.append(torch.einsum("hs,shd->hd", p, v))
    q = torch.cat([torch.einsum("thd,hdl->thl", q_nope, w_uk), q_pe], -1)
    o_lat = md.paged_mla_decode_triton(q, cache, tables, ctx, scale, LORA)
    absorbed = torch.einsum("thl,hdl->thd", o_lat, w_uv)
    check("absorbed = naive (float32)", absorbed, torch.stack(naive), TOL[torch.float32])


class Ceilings:
    def __init__(self):
        n = size(8192, 128)
        a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16 if not SMOKE else torch.float32)
        self.tflops = 2 * n**3 / timeit(lambda: a @ a) / 1e9
        src = torch.empty(size(1 << 30, 1 << 20), dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        self.gbps = 2 * src.numel() / timeit(lambda: dst.copy_(src)) / 1e6
        print(f"ceilings: matmul {self.tflops:.1f} TFLOP/s (bf16 cuBLAS), copy {self.gbps:.0f} GB/s")


def timings(ceil: Ceilings, dtype) -> None:
    print(f"timings ({dtype}): latent read GB/s, TFLOP/s; baselines: torch path, per-head K/V cache")
    cases = size(
        [(1, [32768]), (8, [4096] * 8), (64, [1024] * 64), (16, [128, 32768] * 8)],
        [(2, [40, 130])],
    )
    for heads in size((16, 128), (4,)):
        for batch, lens in cases:
            cache, tables, ctx = latent_pool(lens, LORA + ROPE, dtype)
            q = torch.randn(batch, heads, LORA + ROPE, device=DEV, dtype=dtype)
            scale, max_len, tokens = (NOPE + ROPE) ** -0.5, max(lens), sum(lens)
            args = (q, cache, tables, ctx, scale, LORA)
            ms = timeit(lambda: md.paged_mla_decode_triton(*args, max_context_len=max_len))
            torch_ms = timeit(lambda: md.paged_mla_decode_torch(*args), iters=5)
            nbytes, flops = tokens * (LORA + ROPE) * cache.element_size(), 2 * tokens * heads * (2 * LORA + ROPE)
            row = {
                "name": f"H{heads} B={batch} ctx={min(lens)}..{max_len}",
                "heads": heads,
                "batch": batch,
                "tokens": tokens,
                "ms": ms,
                "gbps": nbytes / ms / 1e6,
                "pct_copy": 100 * nbytes / ms / 1e6 / ceil.gbps,
                "tflops": flops / ms / 1e9,
                "pct_matmul": 100 * flops / ms / 1e9 / ceil.tflops,
                "torch_ms": torch_ms,
                "naive_ms": None,
                "naive_bytes_read_per_token": heads * (NOPE + ROPE) * 2 * cache.element_size(),
            }
            naive_bytes = tokens * row["naive_bytes_read_per_token"]
            del cache
            if naive_bytes <= 8 << 30:
                k_cache, tables_kv, _ = latent_pool(lens, NOPE + ROPE, dtype, heads_kv=heads)
                v_cache = torch.zeros_like(k_cache)
                v_cache[..., :V_DIM] = torch.randn_like(k_cache[..., :V_DIM])
                qn = torch.randn(batch, heads, NOPE + ROPE, device=DEV, dtype=dtype)
                row["naive_ms"] = timeit(
                    lambda: pa.paged_attention_decode_triton(
                        qn, k_cache, v_cache, tables_kv, ctx, softmax_scale=scale, max_context_len=max_len
                    )
                )
                del k_cache, v_cache
            naive = f"  per-head K/V {row['naive_ms']:.3f} ms" if row["naive_ms"] is not None else ""
            print(
                f"  {row['name']:<30} {ms:8.3f} ms {row['gbps']:7.0f} GB/s ({row['pct_copy']:3.0f}% copy) "
                f"{row['tflops']:6.1f} TFLOP/s ({row['pct_matmul']:3.0f}% mm)  torch path {torch_ms:.3f} ms{naive}"
            )
            ROWS.append(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--out", type=Path, default=None, help="folder for mla_gpu.{json,png}")
    args = parser.parse_args()
    if DEV.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke to exercise the script under the interpreter")
        return 2
    torch.manual_seed(0)
    dtype = torch.float16 if args.smoke else torch.bfloat16  # the interpreter computes bf16 wrongly
    out = args.out or (Path(tempfile.mkdtemp(prefix="baton-mla-smoke-")) if args.smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU, Triton interpreter (smoke)"
    ceil = Ceilings()
    for section in (checks, lambda: timings(ceil, dtype)):
        try:
            section()
        except Exception as e:  # a broken section must not cost the other's results (device time is scarce)
            traceback.print_exc()
            FAILURES.append(f"section stopped: {type(e).__name__}: {e}")
        result = {
            "device": device,
            "timing_dtype": str(dtype),
            "ceilings": {"matmul_tflops": ceil.tflops, "copy_gbps": ceil.gbps},
            "checks": CHECKS,
            "timings": ROWS,
            "failures": FAILURES,
        }
        (out / "mla_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(ROWS, device, out / "mla_gpu.png")
    print(f"wrote {out / 'mla_gpu.json'} and {out / 'mla_gpu.png'}")
    print(f"\n{len(FAILURES)} failure(s)" + "".join(f"\n  {f}" for f in FAILURES))
    return 1 if FAILURES else 0


def plot(rows: list[dict], device: str, path: Path) -> None:
    """Share of the copy and matmul ceilings per case (left), speed-up over the baselines (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows][::-1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 0.4 * len(rows) + 1.8), sharey=True)
    y = range(len(names))
    a.barh([i + 0.2 for i in y], [r["pct_copy"] for r in rows][::-1], height=0.4, label="% of copy GB/s")
    a.barh([i - 0.2 for i in y], [r["pct_matmul"] for r in rows][::-1], height=0.4, label="% of matmul TFLOP/s")
    a.set_yticks(list(y), names)
    a.legend()
    b.barh([i + 0.2 for i in y], [r["torch_ms"] / r["ms"] for r in rows][::-1], height=0.4, label="vs torch path")
    b.barh(
        [i - 0.2 for i in y],
        [(r["naive_ms"] or 0) / r["ms"] for r in rows][::-1],
        height=0.4,
        label="vs per-head K/V cache (0: did not fit)",
    )
    b.axvline(1.0, color="k", lw=0.8)
    b.set_xlabel("speed-up (x)")
    b.legend()
    fig.suptitle(f"paged MLA decode (Triton) on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
