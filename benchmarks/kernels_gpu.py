"""Check every baton.kernels Triton kernel against its reference on CUDA, then time it.

    python benchmarks/kernels_gpu.py            # on a GPU: checks (fp16 + bf16), then timings (bf16)
    python benchmarks/kernels_gpu.py --smoke    # no GPU: tiny shapes under the Triton interpreter

Through the device tool (its image has torch and triton but not Baton; nothing to fetch there), one call:

    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . && \
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/kernels_gpu.py --out $OUT 2>&1 | tee $OUT/log.txt

Timings are medians of CUDA-event-timed runs after warm-up. Each row reports achieved TFLOP/s
(compute-bound kernels) or GB/s (bandwidth-bound ones) and its share of the ceilings measured at
start-up: a large bf16 cuBLAS matmul and a large device-to-device copy. Baselines: torch SDPA for
attention, cuBLAS (F.linear on the dequantised weight) / torch._int_mm for the quantised matmuls.
The decode section compares FlashDecoding split-K with and without FlashDecoding++'s unified max.
Attention sinks (gpt-oss) and logit soft-capping (Gemma 2/3) are checked on every attention kernel
(forward, backward with the sinks' gradient, paged prefix, decode) and timed against the plain kernel.
Writes OUT/kernels_gpu.{json,png} (OUT: --out, by default benchmarks/results; a temporary folder in
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
import torch.nn.functional as F  # noqa: E402

from baton.kernels import activation, kv_cache, quant, quant_matmul as qm, reference as ref  # noqa: E402
from baton.kernels import rmsnorm, rotary, w8a8  # noqa: E402
from baton.kernels import flash_attention as fa, paged_attention as pa  # noqa: E402
from baton.common.rope import inv_frequencies, rotary_cos_sin  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import median_ms  # noqa: E402, I001  (the script dir is on sys.path)

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
DEV = torch.device("cuda" if torch.cuda.is_available() and not SMOKE else "cpu")
TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4}  # max |err| / max |ref|
FAILURES: list[str] = []
SECTION = ""  # the section being run, recorded with each timing
CHECKS: list[dict] = []  # every check, for the JSON
ROWS: list[dict] = []  # every timing, for the JSON and the plot
RESULTS = Path(__file__).resolve().parent / "results"


def size(gpu, smoke):
    return smoke if SMOKE else gpu


def timeit(fn, iters: int = 20) -> float:
    """Median milliseconds of fn() (CUDA events on GPU, wall clock in smoke mode)."""
    return median_ms(fn, DEV, size(iters, 1))


def check(name: str, got, want, tol: float | None = None) -> None:
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    for g, w in zip(got, want):
        err = ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp(min=1e-6)).item()
        ok = err <= (tol if tol is not None else TOL[w.dtype])
        if not ok:
            FAILURES.append(f"{name}: relative error {err:.2e}")
        CHECKS.append({"name": name, "rel_err": err, "tol": tol if tol is not None else TOL[w.dtype], "ok": ok})
        print(f"  check {name:<52} rel err {err:9.2e}  {'ok' if ok else 'FAIL'}")


class Ceilings:
    """Measured peaks the achieved numbers are compared with."""

    def __init__(self):
        n = size(8192, 128)
        a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16 if not SMOKE else torch.float32)
        self.tflops = 2 * n**3 / timeit(lambda: a @ a) / 1e9
        src = torch.empty(size(1 << 30, 1 << 20), dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        self.gbps = 2 * src.numel() / timeit(lambda: dst.copy_(src)) / 1e6
        print(f"ceilings: matmul {self.tflops:.1f} TFLOP/s (bf16 cuBLAS), copy {self.gbps:.0f} GB/s")


def report(name: str, ms: float, *, flops=None, nbytes=None, base_ms=None, base_name="", ceil: Ceilings):
    row = {"section": SECTION, "name": name, "ms": ms, "baseline": base_name or None, "baseline_ms": base_ms}
    if flops is not None:
        row.update(tflops=flops / ms / 1e9, pct_of_ceiling=100 * flops / ms / 1e9 / ceil.tflops, ceiling="matmul")
        perf = f"{row['tflops']:8.1f} TFLOP/s ({row['pct_of_ceiling']:4.0f}% mm)"
    else:
        row.update(gbps=nbytes / ms / 1e6, pct_of_ceiling=100 * nbytes / ms / 1e6 / ceil.gbps, ceiling="copy")
        perf = f"{row['gbps']:8.0f} GB/s    ({row['pct_of_ceiling']:4.0f}% copy)"
    base = f"  | {base_name} {base_ms:.3f} ms ({base_ms / ms:.2f}x)" if base_ms is not None else ""
    print(f"  {name:<44} {ms:9.3f} ms  {perf}{base}")
    ROWS.append(row)


def visible_pairs(q_len: int, k_len: int, causal: bool, window: int | None) -> int:
    total = 0
    for i in range(q_len):
        pos = k_len - q_len + i
        hi = pos + 1 if causal else k_len
        lo = max(0, pos - window + 1) if window else 0
        total += max(0, min(hi, k_len) - lo)
    return total


def _varlen(lens, hq, hkv, d, dtype):
    cu = torch.tensor([0, *lens], device=DEV).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens), hq, d, device=DEV, dtype=dtype)
    k, v = torch.randn(2, sum(lens), hkv, d, device=DEV, dtype=dtype)
    return q, k, v, cu, max(lens)


def bench_attention(ceil: Ceilings, dtype, check_dtypes):
    print("prefill attention (FlashAttention-2 varlen)")
    hq, hkv, d = size(32, 4), size(8, 2), size(128, 32)
    for dt in check_dtypes:
        for window in (None, size(256, 8)):
            q, k, v, cu, mx = _varlen(size([1, 100, 1000, 2048], [1, 20, 40]), hq, hkv, d, dt)
            kw = dict(causal=True, sliding_window=window)
            check(
                f"flash fwd {dt} window={window}",
                fa.flash_attn_fwd_triton(q, k, v, cu, cu, mx, **kw)[0],
                ref.flash_attn_varlen_ref(q, k, v, cu, cu, mx, mx, **kw),
            )
            qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
            dout = torch.randn_like(q)
            got = torch.autograd.grad(fa.flash_attn_varlen_triton(qr, kr, vr, cu, cu, mx, mx, **kw), (qr, kr, vr), dout)
            want = torch.autograd.grad(ref.flash_attn_varlen_ref(qr, kr, vr, cu, cu, mx, mx, **kw), (qr, kr, vr), dout)
            check(f"flash bwd {dt} window={window}", got, want)
            for tag, extra in extras(hq):  # attention sinks, soft-capping: forward, then dq/dk/dv/dsinks
                kw = dict(causal=True, sliding_window=window, **extra)
                got = fa.flash_attn_fwd_triton(q, k, v, cu, cu, mx, **kw)[0]
                check(
                    f"flash fwd {dt} window={window} {tag}",
                    got,
                    ref.flash_attn_varlen_ref(q, k, v, cu, cu, mx, mx, **kw),
                )
                sr = extra["sinks"].clone().requires_grad_() if extra.get("sinks") is not None else None
                leaves = (qr, kr, vr) + ((sr,) if sr is not None else ())
                kw["sinks"] = sr
                got = torch.autograd.grad(fa.flash_attn_varlen_triton(qr, kr, vr, cu, cu, mx, mx, **kw), leaves, dout)
                want = torch.autograd.grad(ref.flash_attn_varlen_ref(qr, kr, vr, cu, cu, mx, mx, **kw), leaves, dout)
                check(f"flash bwd {dt} window={window} {tag}", got, want, tol=TOL[dt])

    seqs, seq_len = size(8, 2), size(2048, 64)
    for window in (None, size(1024, 16)):
        q, k, v, cu, mx = _varlen([seq_len] * seqs, hq, hkv, d, dtype)
        flops = 4 * seqs * visible_pairs(seq_len, seq_len, True, window) * hq * d
        ms = timeit(lambda: fa.flash_attn_fwd_triton(q, k, v, cu, cu, mx, sliding_window=window))
        qb, kb, vb = (x.view(seqs, seq_len, -1, d).transpose(1, 2) for x in (q, k, v))
        mask = None if window is None else ref.attention_mask(seq_len, seq_len, True, window, DEV)
        sdpa = (
            (lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True))
            if window is None
            else (lambda: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True))
        )
        report(
            f"fwd {seqs}x{seq_len} h{hq}/{hkv} d{d} win={window}",
            ms,
            flops=flops,
            base_ms=timeit(sdpa),
            base_name="SDPA",
            ceil=ceil,
        )
        both = extras(hq)[-1][1]
        ms_x = timeit(lambda: fa.flash_attn_fwd_triton(q, k, v, cu, cu, mx, sliding_window=window, **both))
        report(f"fwd win={window} sinks+softcap", ms_x, flops=flops, base_ms=ms, base_name="vs plain", ceil=ceil)

        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        out = fa.flash_attn_varlen_triton(qr, kr, vr, cu, cu, mx, mx, sliding_window=window)
        dout = torch.randn_like(out)
        ms = timeit(lambda: torch.autograd.grad(out, (qr, kr, vr), dout, retain_graph=True))
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (qb, kb, vb))
        out_s = F.scaled_dot_product_attention(qs, ks, vs, is_causal=window is None, attn_mask=mask, enable_gqa=True)
        dout_s = torch.randn_like(out_s)
        base = timeit(lambda: torch.autograd.grad(out_s, (qs, ks, vs), dout_s, retain_graph=True))
        report(f"bwd {seqs}x{seq_len} win={window}", ms, flops=2.5 * flops, base_ms=base, base_name="SDPA", ceil=ceil)


def extras(hq: int) -> list[tuple[str, dict]]:
    """Attention sinks ([Hq] float32, some dominant) and a soft-cap low enough to bind (scores ~N(0, 1))."""
    sinks = torch.randn(hq, device=DEV) * 3
    return [
        ("sinks", dict(sinks=sinks)),
        ("softcap", dict(softcap=2.0)),
        ("sinks+softcap", dict(sinks=sinks, softcap=2.0)),
    ]


def _paged(lens, hkv, d, dtype, block_size=16):
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 1
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, hkv, d, device=DEV, dtype=dtype)
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    tables = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32, device=DEV)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[start : start + n]
        start += n
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEV)


def bench_paged(ceil: Ceilings, dtype, check_dtypes):
    print("paged prefix prefill, KV-cache write, paged decode (split-K, unified max)")
    hq, hkv, d = size(32, 4), size(8, 2), size(128, 32)
    for dt in check_dtypes:
        prefix, new = size([0, 100, 3000], [0, 9, 40]), size([50, 1, 700], [5, 1, 30])
        k_cache, v_cache, tables, plens = _paged(prefix, hkv, d, dt)
        q, k, v, cu, mx = _varlen(new, hq, hkv, d, dt)
        args = (q, k, v, cu, k_cache, v_cache, tables, plens, mx)
        check(
            f"paged prefix {dt}",
            fa.flash_attn_with_paged_prefix_triton(*args),
            ref.flash_attn_with_paged_prefix_ref(*args),
        )
        for tag, extra in extras(hq):
            got = fa.flash_attn_with_paged_prefix_triton(*args, **extra)
            check(f"paged prefix {dt} {tag}", got, ref.flash_attn_with_paged_prefix_ref(*args, **extra))
        lens = size([1, 17, 1000, 5000], [1, 17, 70])
        k_cache, v_cache, tables, ctx = _paged(lens, hkv, d, dt)
        qd = torch.randn(len(lens), hq, d, device=DEV, dtype=dt)
        want = ref.paged_attention_decode_ref(qd, k_cache, v_cache, tables, ctx)
        for est in (None, 4.0, -1e3, 1e3):
            check(
                f"decode {dt} estimate={est}",
                pa.paged_attention_decode_triton(qd, k_cache, v_cache, tables, ctx, max_score_estimate=est),
                want,
            )
        for tag, extra in extras(hq):
            want = ref.paged_attention_decode_ref(qd, k_cache, v_cache, tables, ctx, **extra)
            for est, splits in ((None, None), (None, 1), (1.5, None)):
                got = pa.paged_attention_decode_triton(
                    qd, k_cache, v_cache, tables, ctx, max_score_estimate=est, num_splits=splits, **extra
                )
                check(f"decode {dt} {tag} estimate={est} splits={splits}", got, want)
        kn, vn = torch.randn(2, 64, hkv, d, device=DEV, dtype=dt)
        slots = torch.randperm(k_cache.shape[0] * 16, device=DEV)[:64]
        slots[::7] = -1
        got_k, got_v, want_k, want_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
        kv_cache.reshape_and_cache_triton(kn, vn, got_k, got_v, slots)
        ref.reshape_and_cache_ref(kn, vn, want_k, want_v, slots)
        check(f"reshape_and_cache {dt}", (got_k, got_v), (want_k, want_v))

    seqs, prefix_len, new_len = size(8, 2), size(4096, 64), size(512, 16)
    k_cache, v_cache, tables, plens = _paged([prefix_len] * seqs, hkv, d, dtype)
    q, k, v, cu, mx = _varlen([new_len] * seqs, hq, hkv, d, dtype)
    flops = 4 * seqs * visible_pairs(new_len, prefix_len + new_len, True, None) * hq * d
    ms = timeit(lambda: fa.flash_attn_with_paged_prefix_triton(q, k, v, cu, k_cache, v_cache, tables, plens, mx))
    report(f"paged prefix {seqs}x({prefix_len}+{new_len})", ms, flops=flops, ceil=ceil)

    tokens = size(8192, 64)
    kn, vn = torch.randn(2, tokens, hkv, d, device=DEV, dtype=dtype)
    k_cache, v_cache, _, _ = _paged([tokens], hkv, d, dtype)
    slots = torch.randperm(tokens, device=DEV)
    ms = timeit(lambda: kv_cache.reshape_and_cache_triton(kn, vn, k_cache, v_cache, slots))
    report(f"reshape_and_cache {tokens} tokens", ms, nbytes=4 * kn.numel() * kn.element_size(), ceil=ceil)

    # Decode is bandwidth-bound: bytes = the K and V actually read. Unified max pays when the
    # per-tile max/rescale work is not hidden under memory time (short splits, small batches).
    for batch, lens in size(
        [(1, [32768]), (8, [4096] * 8), (64, [1024] * 64), (16, [128, 32768] * 8)], [(2, [40, 130])]
    ):
        k_cache, v_cache, tables, ctx = _paged(lens, hkv, d, dtype)
        qd = torch.randn(batch, hq, d, device=DEV, dtype=dtype)
        nbytes = 2 * sum(lens) * hkv * d * k_cache.element_size()
        max_len = max(lens)
        ms_std = timeit(
            lambda: pa.paged_attention_decode_triton(qd, k_cache, v_cache, tables, ctx, max_context_len=max_len)
        )
        ms_one = timeit(
            lambda: pa.paged_attention_decode_triton(
                qd, k_cache, v_cache, tables, ctx, max_context_len=max_len, num_splits=1
            )
        )
        ms_uni = timeit(
            lambda: pa.paged_attention_decode_triton(
                qd, k_cache, v_cache, tables, ctx, max_context_len=max_len, max_score_estimate=4.0
            )
        )
        kc = torch.zeros(batch, hkv, max_len, d, device=DEV, dtype=dtype)
        mask = torch.arange(max_len, device=DEV)[None, None, None, :] < ctx[:, None, None, None]
        base = timeit(lambda: F.scaled_dot_product_attention(qd[:, :, None], kc, kc, attn_mask=mask, enable_gqa=True))
        tag = f"decode B={batch} ctx={min(lens)}..{max_len}"
        report(f"{tag} split-K", ms_std, nbytes=nbytes, base_ms=base, base_name="SDPA contiguous", ceil=ceil)
        report(f"{tag} one split", ms_one, nbytes=nbytes, ceil=ceil)
        report(f"{tag} unified max", ms_uni, nbytes=nbytes, base_ms=ms_std, base_name="vs split-K", ceil=ceil)
        both = extras(hq)[-1][1]
        ms_x = timeit(
            lambda: pa.paged_attention_decode_triton(qd, k_cache, v_cache, tables, ctx, max_context_len=max_len, **both)
        )
        report(f"{tag} sinks+softcap", ms_x, nbytes=nbytes, base_ms=ms_std, base_name="vs split-K", ceil=ceil)


def bench_elementwise(ceil: Ceilings, dtype, check_dtypes):
    print("RMSNorm + residual, rotary (llama3), SwiGLU")
    rows, hidden, inter = size(16384, 7), size(8192, 300), size(28672, 500)
    hq, hkv, d = size(32, 3), size(8, 1), size(128, 32)
    for dt in check_dtypes:
        x, res = torch.randn(2, 7, 300, device=DEV, dtype=dt)
        w = torch.rand(300, device=DEV, dtype=dt)
        check(f"rms_norm {dt}", rmsnorm.rms_norm_triton(x, w, 1e-5, res), ref.rms_norm_ref(x, w, 1e-5, res))
        q, k = torch.randn(9, 4, 64, device=DEV, dtype=dt), torch.randn(9, 2, 64, device=DEV, dtype=dt)
        cos, sin = rotary_cos_sin(inv_frequencies(64, 5e5, LLAMA3), torch.arange(9, device=DEV) * 1000, dt)
        check(f"rotary {dt}", rotary.apply_rotary_triton(q, k, cos, sin), ref.apply_rotary_ref(q, k, cos, sin))
        g, u = torch.randn(2, 5, 999, device=DEV, dtype=dt)
        check(f"swiglu {dt}", activation.swiglu_triton(g, u), ref.swiglu_ref(g, u))

    x, res = torch.randn(2, rows, hidden, device=DEV, dtype=dtype)
    w = torch.rand(hidden, device=DEV, dtype=dtype)
    ms = timeit(lambda: rmsnorm.rms_norm_triton(x, w, 1e-5, res))
    report(
        f"rms_norm+residual {rows}x{hidden}",
        ms,
        nbytes=4 * x.numel() * x.element_size(),
        base_ms=timeit(lambda: ref.rms_norm_ref(x, w, 1e-5, res)),
        base_name="torch",
        ceil=ceil,
    )
    q, k = torch.randn(rows, hq, d, device=DEV, dtype=dtype), torch.randn(rows, hkv, d, device=DEV, dtype=dtype)
    cos, sin = rotary_cos_sin(inv_frequencies(d), torch.arange(rows, device=DEV), dtype)
    ms = timeit(lambda: rotary.apply_rotary_triton(q, k, cos, sin))
    report(
        f"rotary {rows} tokens h{hq}/{hkv}",
        ms,
        nbytes=2 * (q.numel() + k.numel() + cos.numel()) * q.element_size(),
        base_ms=timeit(lambda: rotary.apply_rotary_torch(q, k, cos, sin)),
        base_name="torch",
        ceil=ceil,
    )
    g, u = torch.randn(2, rows, inter, device=DEV, dtype=dtype)
    ms = timeit(lambda: activation.swiglu_triton(g, u))
    report(
        f"swiglu {rows}x{inter}",
        ms,
        nbytes=3 * g.numel() * g.element_size(),
        base_ms=timeit(lambda: F.silu(g) * u),
        base_name="torch",
        ceil=ceil,
    )


def bench_quant(ceil: Ceilings, dtype, check_dtypes):
    print("quantised matmuls: W8A16, W4A16 (g128), FP8 weight-only, W8A8")
    n, k = size(8192, 96), size(8192, 256)
    w = torch.randn(n, k, device=DEV)
    w8, s8 = quant.quantize_int8_per_channel(w)
    w4, s4, z4 = quant.quantize_int4_groupwise(w, 128)
    wf, sf = quant.quantize_fp8_per_channel(w)
    for dt in check_dtypes:
        x = torch.randn(37, k, device=DEV, dtype=dt)
        check(f"int8 weight {dt}", qm.int8_weight_matmul_triton(x, w8, s8), ref.int8_weight_matmul_ref(x, w8, s8))
        check(
            f"int4 weight {dt}",
            qm.int4_weight_matmul_triton(x, w4, s4, z4, 128),
            ref.int4_weight_matmul_ref(x, w4, s4, z4, 128),
        )
        check(f"fp8 weight {dt}", qm.fp8_weight_matmul_triton(x, wf, sf), ref.fp8_weight_matmul_ref(x, wf, sf))
        xq, xs = w8a8.quantize_per_token_triton(x)
        check(f"quantize_per_token {dt}", xq.float() * xs[:, None], x.float(), tol=0.5 / 127 + 1e-3)  # half a step
        check(f"w8a8 {dt}", w8a8.w8a8_matmul_triton(xq, xs, w8, s8, dt), ref.w8a8_matmul_ref(xq, xs, w8, s8, dt))

    w_dense = w.to(dtype)
    for m in size([1, 16, 4096], [3, 40]):
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        dense = timeit(lambda: F.linear(x, w_dense))
        weight_bound = m <= 16  # decode: reading the weights is the cost -> GB/s; prefill: TFLOP/s
        for name, fn, wbytes in (
            ("int8", lambda: qm.int8_weight_matmul_triton(x, w8, s8), n * k),
            ("int4", lambda: qm.int4_weight_matmul_triton(x, w4, s4, z4, 128), n * k // 2),
            ("fp8", lambda: qm.fp8_weight_matmul_triton(x, wf, sf), n * k),
        ):
            ms = timeit(fn)
            metric = dict(nbytes=wbytes + x.numel() * 2) if weight_bound else dict(flops=2 * m * n * k)
            report(
                f"{name} weight-only M={m} {n}x{k}", ms, base_ms=dense, base_name="cuBLAS dense", ceil=ceil, **metric
            )
        if m >= 32:  # torch._int_mm needs M > 16
            xq, xs = w8a8.quantize_per_token_triton(x)
            ms = timeit(lambda: w8a8.w8a8_matmul_triton(xq, xs, w8, s8, dtype))
            base = timeit(lambda: torch._int_mm(xq, w8.T)) if DEV.type == "cuda" else None
            report(
                f"w8a8 M={m} {n}x{k}",
                ms,
                flops=2 * m * n * k,
                base_ms=base,
                base_name="_int_mm (no epilogue)",
                ceil=ceil,
            )
            ms = timeit(lambda: w8a8.quantize_per_token_triton(x))
            report(f"quantize_per_token {m}x{k}", ms, nbytes=3 * x.numel(), ceil=ceil)


SECTIONS = {"attention": bench_attention, "paged": bench_paged, "elementwise": bench_elementwise, "quant": bench_quant}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--only", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--out", type=Path, default=None, help="folder for kernels_gpu.{json,png}")
    args = parser.parse_args()
    if DEV.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke to exercise the script under the interpreter")
        return 2
    torch.manual_seed(0)
    # the interpreter computes bf16 wrongly, so the smoke run stays in fp16
    dtype = torch.float16 if args.smoke else torch.bfloat16
    check_dtypes = [torch.float16] if args.smoke else [torch.float16, torch.bfloat16]
    ceil = Ceilings()
    out = args.out or (Path(tempfile.mkdtemp(prefix="baton-kernels-smoke-")) if args.smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU, Triton interpreter (smoke)"
    global SECTION
    for SECTION in args.only:
        try:
            SECTIONS[SECTION](ceil, dtype, check_dtypes)
        except Exception as e:  # a broken section must not cost the others' results (device time is scarce)
            traceback.print_exc()
            FAILURES.append(f"section {SECTION} stopped: {type(e).__name__}: {e}")
        # rewritten after every section, so a run stopped at its time limit still leaves what it measured
        (out / "kernels_gpu.json").write_text(
            json.dumps(
                {
                    "device": device,
                    "timing_dtype": str(dtype),
                    "ceilings": {"matmul_tflops": ceil.tflops, "copy_gbps": ceil.gbps},
                    "checks": CHECKS,
                    "timings": ROWS,
                    "failures": FAILURES,
                },
                indent=2,
            )
            + "\n"
        )
    plot(ROWS, device, out / "kernels_gpu.png")
    print(f"wrote {out / 'kernels_gpu.json'} and {out / 'kernels_gpu.png'}")
    print(f"\n{len(FAILURES)} failure(s)" + "".join(f"\n  {f}" for f in FAILURES))
    return 1 if FAILURES else 0


def plot(rows: list[dict], device: str, path: Path) -> None:
    """Share of the measured ceiling per kernel (left) and speed-up over its baseline (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(["attention", "paged", "elementwise", "quant"], ["C0", "C1", "C2", "C3"]))
    names = [r["name"] for r in rows][::-1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 0.28 * len(rows) + 1.5), sharey=True)
    a.barh(names, [r["pct_of_ceiling"] for r in rows][::-1], color=[colours[r["section"]] for r in rows][::-1])
    a.set_xlabel("% of measured ceiling (matmul TFLOP/s or copy GB/s)")
    b.barh(
        names,
        [r["baseline_ms"] / r["ms"] if r["baseline_ms"] else 0 for r in rows][::-1],
        color=[colours[r["section"]] for r in rows][::-1],
    )
    b.axvline(1.0, color="k", lw=0.8)
    b.set_xlabel("speed-up over baseline (x; 0 = no baseline)")
    a.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"baton.kernels Triton kernels on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
