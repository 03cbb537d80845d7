"""baton.kernels: Triton kernels for attention, norms, rotary, SwiGLU and quantised matmuls.

Every public function dispatches: CUDA tensors run the Triton kernel, anything else runs a fast torch
path, so Baton works on any machine. The `*_triton` / `*_torch` variants in each module are the two
paths; `reference` holds the plain-torch specification both are tested against. See docs/kernels.md.
"""


def _shadowed() -> object:
    """The PyPI package's spec if this directory was imported as a top-level `kernels`, else None.

    This directory is baton.kernels. A Python started in a checkout's root (`python -m pytest`,
    `python -c`) also sees it as a top-level package `kernels`, which shadows the PyPI package of
    that name that transformers imports (a dependency of transformers >= 5.25) and so broke every
    transformers model. Imported under that name, it loads the real one in its place where one is
    installed (and else stays what it was: transformers then finds no version and ignores it)."""
    import importlib.machinery
    import os
    import sys

    if __name__ != "kernels":
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    )


if (_spec := _shadowed()) is not None:
    import importlib.util as _util
    import sys as _sys

    _sys.modules["kernels"] = _module = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
else:
    from .activation import swiglu
    from .flash_attention import flash_attn_varlen, flash_attn_with_paged_prefix
    from .gated_delta import decode_step as gated_delta_decode_step
    from .gated_delta import gated_delta_rule
    from .kv_cache import reshape_and_cache
    from .mla_decode import mla_cache_write, paged_mla_decode
    from .paged_attention import paged_attention_decode
    from .quant import quantize_fp8_per_channel, quantize_int4_groupwise, quantize_int8_per_channel, smoothquant_scales
    from .quant_matmul import fp8_weight_matmul, int4_weight_matmul, int8_weight_matmul
    from .rmsnorm import rms_norm
    from .rotary import apply_rotary
    from .w8a8 import quantize_per_token, w8a8_matmul

    __all__ = [
        "flash_attn_varlen",
        "flash_attn_with_paged_prefix",
        "paged_attention_decode",
        "paged_mla_decode",
        "gated_delta_rule",
        "gated_delta_decode_step",
        "reshape_and_cache",
        "mla_cache_write",
        "rms_norm",
        "apply_rotary",
        "swiglu",
        "int8_weight_matmul",
        "int4_weight_matmul",
        "fp8_weight_matmul",
        "w8a8_matmul",
        "quantize_per_token",
        "quantize_int8_per_channel",
        "quantize_int4_groupwise",
        "quantize_fp8_per_channel",
        "smoothquant_scales",
    ]
