"""Compile every Triton kernel for sm_90 and sm_80 with Triton's bundled ptxas - no GPU needed.

Run as a script in a process WITHOUT TRITON_INTERPRET (the jitted functions must be real
JITFunctions). JITFunction.run is replaced by a recorder that, instead of launching, compiles the
launch it was given for each target: so the exact specialisations and constexprs the public
`*_triton` launchers choose are what gets compiled. The launchers run on small CPU tensors.

Prints one JSON object {case: {"sm_90": "ok" | error, "sm_80": ...}}; test_compile.py asserts on it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

TARGETS = {"sm_90": 90, "sm_80": 80}
# Shared memory a block may use (H100 / A100 opt-in maximum): the launch would fail above it, and
# the compiler does not check this itself.
SHARED_LIMIT = {90: 232448, 80: 166912}


def _attn(dtype, head_dim, causal=True, window=None, paged=False, backward=False, sinks=False, softcap=0.0):
    def run():
        from baton.kernels import flash_attention as fa
        from baton.kernels.flash_attention_bwd import flash_attn_bwd_triton

        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        q = torch.zeros(12, 4, head_dim, dtype=dtype)
        k = torch.zeros(12, 2, head_dim, dtype=dtype)
        extra = dict(sinks=torch.zeros(4) if sinks else None, softcap=softcap)
        if paged:
            cache = torch.zeros(4, 16, 2, head_dim, dtype=dtype)
            fa.flash_attn_with_paged_prefix_triton(
                q,
                k,
                k,
                cu,
                cache,
                cache,
                torch.zeros(2, 2, dtype=torch.int32),
                torch.tensor([3, 20], dtype=torch.int32),
                7,
                causal=causal,
                sliding_window=window,
                **extra,
            )
        elif backward:
            lse = torch.zeros(4, 12)
            flash_attn_bwd_triton(
                q, q, k, k, q, lse, cu, cu, 7, 7, causal=causal, sliding_window=window, softcap=softcap
            )
        else:
            fa.flash_attn_fwd_triton(q, k, k, cu, cu, 7, causal=causal, sliding_window=window, with_lse=True, **extra)

    return run


def _decode(dtype, head_dim, group, num_splits, window=None, estimate=None, sinks=False, softcap=0.0):
    def run():
        from baton.kernels.paged_attention import paged_attention_decode_triton

        cache = torch.zeros(8, 16, 2, head_dim, dtype=dtype)
        tables = torch.zeros(3, 8, dtype=torch.int32)
        lens = torch.tensor([1, 60, 128], dtype=torch.int32)
        paged_attention_decode_triton(
            torch.zeros(3, 2 * group, head_dim, dtype=dtype),
            cache,
            cache,
            tables,
            lens,
            sliding_window=window,
            num_splits=num_splits,
            max_score_estimate=estimate,
            sinks=torch.zeros(2 * group) if sinks else None,
            softcap=softcap,
        )

    return run


def _mla(dtype, heads, lora, rope, num_splits):
    def run():
        from baton.kernels.mla_decode import paged_mla_decode_triton

        cache = torch.zeros(8, 16, lora + rope, dtype=dtype)
        tables = torch.zeros(3, 8, dtype=torch.int32)
        lens = torch.tensor([1, 60, 128], dtype=torch.int32)
        q = torch.zeros(3, heads, lora + rope, dtype=dtype)
        paged_mla_decode_triton(q, cache, tables, lens, 0.1, lora, num_splits=num_splits)

    return run


def _elementwise(name, dtype):
    def run():
        from baton.kernels import activation, kv_cache, rmsnorm, rotary

        x = torch.zeros(4, 4096, dtype=dtype)
        if name == "rms_norm":
            rmsnorm.rms_norm_triton(x, torch.zeros(4096, dtype=dtype), 1e-6)
        elif name == "rms_norm_residual":
            rmsnorm.rms_norm_triton(x, torch.zeros(4096, dtype=dtype), 1e-6, residual=x)
        elif name == "rotary":
            rotary.apply_rotary_triton(
                torch.zeros(4, 32, 128, dtype=dtype),
                torch.zeros(4, 8, 128, dtype=dtype),
                torch.zeros(4, 128),
                torch.zeros(4, 128),
            )
        elif name == "swiglu":
            activation.swiglu_triton(x, x)
        elif name == "reshape_and_cache":
            k = torch.zeros(4, 8, 128, dtype=dtype)
            cache = torch.zeros(2, 16, 8, 128, dtype=dtype)
            kv_cache.reshape_and_cache_triton(k, k, cache, cache, torch.zeros(4, dtype=torch.int64))
        elif name == "mla_cache_write":
            from baton.kernels.mla_decode import mla_cache_write_triton

            latent, k_pe = torch.zeros(4, 512, dtype=dtype), torch.zeros(4, 64, dtype=dtype)
            cache = torch.zeros(2, 16, 576, dtype=dtype)
            mla_cache_write_triton(latent, k_pe, cache, torch.zeros(4, dtype=torch.int64))

    return run


def _ssd_scan(dtype, d_state, head_dim, with_state):
    def run():
        from baton.kernels.ssd_scan import ssd_scan_triton

        b, length, heads, groups = 2, 100, 8, 2
        x = torch.zeros(b, length, heads, head_dim, dtype=dtype)
        bc = torch.zeros(b, length, groups, d_state, dtype=dtype)
        init = torch.zeros(b, heads, head_dim, d_state) if with_state else None
        ssd_scan_triton(x, torch.zeros(b, length, heads), torch.zeros(heads), bc, bc, init)

    return run


def _gated_delta(dtype, dk, dv, rep, with_state):
    def run():
        from baton.kernels.gated_delta import gated_delta_decode_triton, gated_delta_rule_triton

        b, length, hk = 2, 100, 2
        qk = torch.zeros(b, length, hk, dk, dtype=dtype)
        v = torch.zeros(b, length, hk * rep, dv, dtype=dtype)
        gb = torch.zeros(b, length, hk * rep)
        init = torch.zeros(b, hk * rep, dk, dv) if with_state else None
        gated_delta_rule_triton(qk, qk, v, gb, gb, init, use_qk_l2norm_in_kernel=True)
        pool, slots = torch.zeros(4, hk * rep, dk, dv), torch.tensor([3, 1])
        step = (qk[:, 0], qk[:, 0], v[:, 0], gb[:, 0], gb[:, 0])
        gated_delta_decode_triton(*step, pool, slots, use_qk_l2norm_in_kernel=True)

    return run


def _quant(fmt, dtype, m):
    def run():
        from baton.kernels import quant_matmul as qm
        from baton.kernels import w8a8

        x = torch.zeros(m, 256, dtype=dtype)
        w8 = torch.zeros(128, 256, dtype=torch.int8)
        s = torch.zeros(128)
        if fmt == "int8":
            qm.int8_weight_matmul_triton(x, w8, s)
        elif fmt == "int4":
            g = torch.zeros(128, 2)
            qm.int4_weight_matmul_triton(x, torch.zeros(128, 128, dtype=torch.uint8), g, g, 128)
        elif fmt == "fp8":
            qm.fp8_weight_matmul_triton(x, torch.zeros(128, 256, dtype=torch.float8_e4m3fn), s)
        elif fmt == "w8a8":
            w8a8.w8a8_matmul_triton(torch.zeros(m, 256, dtype=torch.int8), torch.zeros(m), w8, s, dtype)
        elif fmt == "quantize_per_token":
            w8a8.quantize_per_token_triton(x)

    return run


f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
CASES = {
    "flash_fwd_bf16_d128_causal": _attn(bf16, 128),
    "flash_fwd_f16_d64_window": _attn(f16, 64, window=32),
    "flash_fwd_f32_d64_noncausal": _attn(f32, 64, causal=False),
    "flash_fwd_f16_d80_paged_prefix": _attn(f16, 80, paged=True),
    "flash_fwd_bf16_d128_paged_prefix_window": _attn(bf16, 128, window=64, paged=True),
    "flash_bwd_bf16_d128_causal": _attn(bf16, 128, backward=True),
    "flash_bwd_f16_d64_window": _attn(f16, 64, window=32, backward=True),
    "flash_bwd_f32_d64_noncausal": _attn(f32, 64, causal=False, backward=True),
    "decode_bf16_d128_gqa4_split": _decode(bf16, 128, 4, 4),
    "decode_f16_d64_mha_direct": _decode(f16, 64, 1, 1),
    "decode_f32_d64_gqa8_window_split": _decode(f32, 64, 8, 3, window=50),
    "decode_unified_max_bf16_d128_gqa4_split": _decode(bf16, 128, 4, 4, estimate=5.0),
    "decode_unified_max_f16_d64_direct": _decode(f16, 64, 2, 1, estimate=5.0),
    # attention sinks (gpt-oss) and logit soft-capping (Gemma 2/3)
    "flash_fwd_bf16_d64_sinks_softcap_window": _attn(bf16, 64, window=32, sinks=True, softcap=30.0),
    "flash_fwd_f16_d128_paged_prefix_sinks_softcap": _attn(f16, 128, paged=True, sinks=True, softcap=50.0),
    "flash_bwd_bf16_d128_softcap": _attn(bf16, 128, backward=True, softcap=30.0),
    "decode_bf16_d64_gqa8_sinks_softcap_split": _decode(bf16, 64, 8, 4, sinks=True, softcap=30.0),
    "decode_f16_d128_sinks_direct_window": _decode(f16, 128, 4, 1, window=50, sinks=True),
    "decode_unified_max_bf16_d128_sinks_softcap_split": _decode(
        bf16, 128, 4, 4, estimate=5.0, sinks=True, softcap=30.0
    ),
    # MLA decode over the latent cache: DeepSeek-V3's L 512 + R 64 (all 128 heads, and 16 of a TP rank),
    # and odd small dims in float32 (the interpreter tests' shapes)
    "mla_decode_bf16_l512_r64_h128_split": _mla(bf16, 128, 512, 64, 4),
    "mla_decode_f16_l512_r64_h16_direct": _mla(f16, 16, 512, 64, 1),
    "mla_decode_f32_l512_r64_h16_split": _mla(f32, 16, 512, 64, 3),
    "mla_decode_f32_l36_r8_h20_direct": _mla(f32, 20, 36, 8, 1),
    **{
        f"{name}_{tag}": _elementwise(name, dt)
        for name in ("rms_norm", "rms_norm_residual", "rotary", "swiglu", "reshape_and_cache", "mla_cache_write")
        for tag, dt in (("bf16", bf16), ("f32", f32))
    },
    **{
        f"{fmt}_{tag}_m{m}": _quant(fmt, dt, m)
        for fmt in ("int8", "int4", "fp8", "w8a8")
        for tag, dt in (("bf16", bf16), ("f16", f16))
        for m in (4, 100)
    },
    "quantize_per_token_bf16": _quant("quantize_per_token", bf16, 100),
    "ssd_scan_bf16_n128_p64": _ssd_scan(bf16, 128, 64, with_state=False),
    "ssd_scan_bf16_n256_p64_state": _ssd_scan(bf16, 256, 64, with_state=True),
    "ssd_scan_f32_n16_p8_state": _ssd_scan(f32, 16, 8, with_state=True),
    # Qwen3.5 / Qwen3-Next (Dk = Dv = 128, 2 value heads per key head), the largest tiles (256), odd small dims
    "gated_delta_bf16_k128_v128_gqa2_state": _gated_delta(bf16, 128, 128, 2, with_state=True),
    "gated_delta_f16_k256_v256": _gated_delta(f16, 256, 256, 1, with_state=False),
    "gated_delta_f32_k24_v40_gqa2_state": _gated_delta(f32, 24, 40, 2, with_state=True),
}


def _install_compiling_run(results: dict, case: list[str]) -> None:
    """Replace JITFunction.run so a launch compiles for every target and records the outcome."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    def run(self, *args, grid, warmup, **kwargs):
        for label, cc in TARGETS.items():
            target = GPUTarget("cuda", cc, 32)
            backend = make_backend(target)
            try:
                binder = create_function_from_signature(self.signature, self.params, backend)
                bound, specialization, options = binder(*args, **kwargs)
                options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
                kernel = triton.compile(
                    ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__
                )
                shared = kernel.metadata.shared
                outcome = "ok" if shared <= SHARED_LIMIT[cc] else f"{self.__name__}: {shared} B of shared memory"
            except Exception as e:  # noqa: BLE001 - every compiler error is a result to report
                outcome = f"{self.__name__}: {type(e).__name__}: {e}"[:2000]
            previous = results[case[0]].get(label, "ok")
            results[case[0]][label] = outcome if previous == "ok" else previous
        return None

    JITFunction.run = run


def main(names: list[str]) -> dict:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "compile checks need real JITFunctions"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    results: dict[str, dict[str, str]] = {}
    case = [""]
    _install_compiling_run(results, case)
    for name in names:
        case[0] = name
        results[name] = {}
        try:
            CASES[name]()
        except Exception:  # noqa: BLE001 - a launcher crash is reported against its case
            results[name] = {label: "launcher failed: " + traceback.format_exc()[-2000:] for label in TARGETS}
        if not results[name]:
            results[name] = {label: "no kernel was launched" for label in TARGETS}
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:] or list(CASES))))
