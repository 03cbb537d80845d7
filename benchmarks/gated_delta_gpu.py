"""Check the gated delta rule's Triton kernels (kernels/gated_delta.py) on CUDA against float64, then time them.

    python benchmarks/gated_delta_gpu.py            # on a GPU: checks (fp32, fp16, bf16), timings (bf16)
    python benchmarks/gated_delta_gpu.py --smoke    # no GPU: tiny shapes under the Triton interpreter

Through the device tool (its image has torch and triton but not Baton; nothing to fetch there), one call:

    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . && \
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/gated_delta_gpu.py --out $OUT 2>&1 | tee $OUT/log.txt

Checks, each as max |error| / max |reference|: the chunked kernels (odd lengths, one token, carried state,
grouped heads 2:1 as Qwen3.5's 16:32, Dk = Dv = 128 and odd 24/40, q/k normalised in the kernel or not)
against gated_delta_rule_ref in float64; repeated keys and a fast decay before a slow one in fp32; the
decode kernel over a slot pool for several steps (untouched slots unchanged); 4096 tokens against the
torch chunked form in fp32; the dispatchers' CUDA branches. Timings: medians of CUDA-event-timed runs after
warm-up at Qwen3.5's head counts (Hk 16, Hv 32, Dk = Dv = 128), against the torch chunked form on the same
GPU (and fla's chunk_gated_delta_rule when installed): prefill as tokens/s, decode as GB/s of state read
and written, next to a large device copy's GB/s. Writes OUT/gated_delta_gpu.{json,png} (OUT: --out, default
benchmarks/results; a temporary folder in smoke mode, whose timings mean nothing). Exit status 1 if any
check fails, 2 without CUDA (and no --smoke).
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
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")  # the torch baselines' matmuls in full fp32

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton.kernels import gated_delta as gd  # noqa: E402
from gpu_timing import median_ms  # noqa: E402  (the script dir is on sys.path)

DEV = torch.device("cuda" if torch.cuda.is_available() and not SMOKE else "cpu")
TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float32: 1e-4}  # max |err| / max |ref|
RESULTS = Path(__file__).resolve().parent / "results"
NORM = dict(use_qk_l2norm_in_kernel=True)
FAILURES: list[str] = []
CHECKS: list[dict] = []
ROWS: list[dict] = []


def size(gpu, smoke):
    return smoke if SMOKE else gpu


def timeit(fn, iters: int = 20) -> float:
    """Median milliseconds of fn() (CUDA events on GPU, wall clock in smoke mode)."""
    return median_ms(fn, DEV, size(iters, 1))


def check(name: str, got, want, tol: float) -> None:
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    for g, w in zip(got, want):
        err = ((g.double() - w.double()).abs().max() / w.double().abs().max().clamp(min=1e-6)).item()
        ok = err <= tol
        if not ok:
            FAILURES.append(f"{name}: relative error {err:.2e}")
        CHECKS.append({"name": name, "rel_err": err, "tol": tol, "ok": ok})
        print(f"  check {name:<60} rel err {err:9.2e}  {'ok' if ok else 'FAIL'}")


def inputs(b, length, hk, hv, dk, dv, dtype, with_state=True, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q, k = (torch.randn(b, length, hk, dk, generator=gen, device=DEV).to(dtype) for _ in range(2))
    v = torch.randn(b, length, hv, dv, generator=gen, device=DEV).to(dtype)
    g = -0.7 * torch.rand(b, length, hv, generator=gen, device=DEV)
    beta = torch.rand(b, length, hv, generator=gen, device=DEV)
    s0 = torch.randn(b, hv, dk, dv, generator=gen, device=DEV) if with_state else None
    return q, k, v, g, beta, s0


def checks(dtypes) -> None:
    print("checks against the float64 reference")
    shapes = [
        dict(b=2, length=size(300, 37), hk=size(4, 2), hv=size(8, 4), dk=size(128, 16), dv=size(128, 24)),
        dict(b=3, length=1, hk=2, hv=4, dk=size(128, 16), dv=size(128, 16)),
        dict(b=1, length=size(200, 70), hk=1, hv=2, dk=24, dv=40),
    ]
    for dtype in [torch.float32, *dtypes]:
        for shape in shapes:
            for l2 in (True, False):
                q, k, v, g, beta, s0 = inputs(**shape, dtype=dtype)
                if not l2:
                    k = gd.l2norm(k.float()).to(dtype)  # the caller normalised k; q keeps its own scale
                kw = dict(use_qk_l2norm_in_kernel=l2)
                want = gd.gated_delta_rule_ref(q, k, v, g, beta, s0, **kw)
                dims = f"T={shape['length']} h{shape['hk']}/{shape['hv']} d{shape['dk']}/{shape['dv']}"
                name = f"chunked {str(dtype)[6:]} {dims} l2={l2}"
                check(name, gd.gated_delta_rule_triton(q, k, v, g, beta, s0, **kw), want, TOL[dtype])
        # carried state: two calls = one pass
        q, k, v, g, beta, s0 = inputs(**shapes[0], dtype=dtype)
        cut = shapes[0]["length"] // 2 + 7
        o1, s1 = gd.gated_delta_rule_triton(*(t[:, :cut] for t in (q, k, v, g, beta)), s0, **NORM)
        o2, s2 = gd.gated_delta_rule_triton(*(t[:, cut:] for t in (q, k, v, g, beta)), s1, **NORM)
        want = gd.gated_delta_rule_ref(q, k, v, g, beta, s0, **NORM)
        check(f"chunked {str(dtype)[6:]} carried state", (torch.cat([o1, o2], 1), s2), want, TOL[dtype])
        # decode over a pool: 3 rows in slots 4, 0, 2 of 6, four steps
        q, k, v, g, beta, s0 = inputs(3, 4, 2, 4, size(128, 16), size(128, 24), dtype)
        pool = torch.randn(6, *s0.shape[1:], device=DEV)
        slots = torch.tensor([4, 0, 2], device=DEV)
        pool[slots] = s0
        before = pool.clone()
        want_o, want_s = gd.gated_delta_rule_ref(q, k, v, g, beta, s0, **NORM)
        outs = [gd.decode_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pool, slots, **NORM) for t in range(4)]
        check(
            f"decode {str(dtype)[6:]} over a slot pool",
            (torch.stack(outs, 1), pool[slots]),
            (want_o, want_s),
            TOL[dtype],
        )
        unchanged = torch.equal(pool[[1, 3, 5]], before[[1, 3, 5]])
        CHECKS.append({"name": f"decode {dtype} leaves other slots", "ok": unchanged})
        if not unchanged:
            FAILURES.append(f"decode {dtype}: slots outside the batch changed")
    # fp32 edge cases
    q, k, v, g, beta, _ = inputs(1, 64, 1, 2, size(128, 16), size(128, 16), torch.float32, with_state=False)
    g = torch.full_like(g, -0.01)
    g[:, :40] = -250.0
    check("chunked fp32 fast decay before slow", gd.gated_delta_rule_triton(q, k, v, g, beta, **NORM),
          gd.gated_delta_rule_ref(q, k, v, g, beta, **NORM), 1e-4)  # fmt: skip
    k = k[:, :1].expand_as(k)
    g, beta = torch.zeros_like(g), torch.ones_like(beta)
    check("chunked fp32 repeated keys", gd.gated_delta_rule_triton(q, k, v, g, beta, **NORM),
          gd.gated_delta_rule_ref(q, k, v, g, beta, **NORM), 1e-4)  # fmt: skip
    # long: the torch chunked form on the same device as the reference (the loop would take minutes)
    x = inputs(1, size(4096, 200), size(4, 1), size(8, 2), size(128, 16), size(128, 16), torch.float32)
    check(
        "chunked fp32 long vs torch chunked",
        gd.gated_delta_rule_triton(*x, **NORM),
        gd.gated_delta_rule_torch(*x, **NORM),
        1e-4,
    )
    # the dispatchers' CUDA branch (on the GPU: no autograd -> Triton; autograd -> torch chunked, differentiable)
    x = inputs(2, 50, 2, 4, size(128, 16), size(128, 16), torch.float32)
    want = gd.gated_delta_rule_ref(*x, **NORM)
    check("dispatcher (inference)", gd.gated_delta_rule(*x, **NORM), want, 1e-4)
    o, s = gd.gated_delta_rule(x[0].clone().requires_grad_(), *x[1:], **NORM)
    check("dispatcher (autograd)", (o.detach(), s.detach()), want, 1e-4)
    if not o.requires_grad:
        FAILURES.append("dispatcher: no autograd graph with requires_grad inputs")


class Ceilings:
    def __init__(self):
        src = torch.empty(size(1 << 30, 1 << 20), dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        self.gbps = 2 * src.numel() / timeit(lambda: dst.copy_(src)) / 1e6
        print(f"ceiling: copy {self.gbps:.0f} GB/s")


def fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - optional baseline
        return None
    return lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, **NORM)


def timings(ceil: Ceilings, dtype) -> None:
    print(f"timings ({dtype})")
    hk, hv, d = size(16, 1), size(32, 2), size(128, 16)
    fla = fla_chunk()
    for b, length in size([(1, 1024), (1, 4096), (1, 16384), (8, 2048)], [(1, 64), (2, 100)]):
        q, k, v, g, beta, _ = inputs(b, length, hk, hv, d, d, dtype, with_state=False)
        ms = timeit(lambda: gd.gated_delta_rule_triton(q, k, v, g, beta, **NORM))
        row = {"section": "prefill", "name": f"prefill B={b} T={length}", "ms": ms, "tok_per_s": b * length / ms * 1e3}
        row["torch_ms"] = timeit(lambda: gd.gated_delta_rule_torch(q, k, v, g, beta, **NORM), size(5, 1))
        if fla is not None:
            row["fla_ms"] = timeit(lambda: fla(q, k, v, g, beta))
        ROWS.append(row)
        extra = f"  fla {row['fla_ms']:.3f} ms" if fla is not None else ""
        print(f"  {row['name']:<28} {ms:9.3f} ms  {row['tok_per_s'] / 1e6:7.2f} Mtok/s  | torch chunked "
              f"{row['torch_ms']:.3f} ms ({row['torch_ms'] / ms:.1f}x){extra}")  # fmt: skip
    for n in size([1, 8, 64, 256], [1, 4]):
        q, k, v, g, beta, _ = (t[:, 0] if t is not None else None for t in inputs(n, 1, hk, hv, d, d, dtype, False))
        pool = torch.zeros(2 * n, hv, d, d, device=DEV)
        slots = torch.randperm(2 * n, device=DEV)[:n]
        ms = timeit(lambda: gd.gated_delta_decode_triton(q, k, v, g, beta, pool, slots, **NORM), 100)
        gbps = 2 * n * hv * d * d * 4 / ms / 1e6
        row = {
            "section": "decode",
            "name": f"decode N={n}",
            "ms": ms,
            "state_gbps": gbps,
            "pct_copy": 100 * gbps / ceil.gbps,
        }
        row["torch_ms"] = timeit(lambda: gd.gated_delta_decode_torch(q, k, v, g, beta, pool, slots, **NORM), 100)
        ROWS.append(row)
        print(f"  {row['name']:<28} {ms:9.3f} ms  {gbps:7.0f} GB/s of state ({row['pct_copy']:.0f}% of copy)"
              f"  | torch {row['torch_ms']:.3f} ms ({row['torch_ms'] / ms:.1f}x)")  # fmt: skip


def plot(rows: list[dict], device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows][::-1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.8), sharey=True)
    a.barh(
        names, [r["ms"] for r in rows][::-1], color=["C0" if r["section"] == "prefill" else "C1" for r in rows][::-1]
    )
    a.set(xscale="log", xlabel="ms (Triton)")
    b.barh(names, [r["torch_ms"] / r["ms"] for r in rows][::-1], color="C2")
    b.set_xlabel("speed-up over the torch path on the same device")
    fig.suptitle(f"Gated delta rule kernels on {device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--out", type=Path, default=None, help="folder for gated_delta_gpu.{json,png}")
    args = parser.parse_args()
    if DEV.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke to exercise the script under the interpreter")
        return 2
    torch.manual_seed(0)
    dtype = torch.float16 if args.smoke else torch.bfloat16  # the interpreter computes bf16 wrongly
    out = args.out or (Path(tempfile.mkdtemp(prefix="baton-gdn-smoke-")) if args.smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU, Triton interpreter (smoke)"
    ceil = Ceilings()
    check_dtypes = [torch.float16] if args.smoke else [torch.float16, torch.bfloat16]
    for section in (lambda: checks(check_dtypes), lambda: timings(ceil, dtype)):
        try:
            section()
        except Exception as e:  # a broken section must not cost the other's results (device time is scarce)
            traceback.print_exc()
            FAILURES.append(f"section stopped: {type(e).__name__}: {e}")
        result = {"device": device, "timing_dtype": str(dtype), "copy_gbps": ceil.gbps, "checks": CHECKS,
                  "timings": ROWS, "failures": FAILURES}  # fmt: skip
        (out / "gated_delta_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    if ROWS:
        plot(ROWS, device, out / "gated_delta_gpu.png")
    print(f"wrote {out / 'gated_delta_gpu.json'} and {out / 'gated_delta_gpu.png'}")
    print(f"\n{len(FAILURES)} failure(s)" + "".join(f"\n  {f}" for f in FAILURES))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
