"""baton.kernels: Triton kernels for attention, norms, rotary, SwiGLU and quantised matmuls.

Every public function dispatches: CUDA tensors run the Triton kernel, anything else runs a fast torch
path, so Baton works on any machine. The `*_triton` / `*_torch` variants in each module are the two
paths; `reference` holds the plain-torch specification both are tested against. See docs/kernels.md.
"""

from .flash_attention import flash_attn_varlen, flash_attn_with_paged_prefix
from .kv_cache import reshape_and_cache
from .paged_attention import paged_attention_decode
from .quant import quantize_fp8_per_channel, quantize_int4_groupwise, quantize_int8_per_channel, smoothquant_scales
from .quant_matmul import fp8_weight_matmul, int4_weight_matmul, int8_weight_matmul
from .rmsnorm import rms_norm
from .rotary import apply_rotary
from .activation import swiglu
from .w8a8 import quantize_per_token, w8a8_matmul

__all__ = [
    "flash_attn_varlen",
    "flash_attn_with_paged_prefix",
    "paged_attention_decode",
    "reshape_and_cache",
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
