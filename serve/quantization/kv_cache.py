"""KV-cache quantization (int8 or fp8 e4m3) with one scale per token and KV head.

A quantized pool is uint8 [blocks, block_size, kv_heads, head_dim + 4]: head_dim bytes of codes,
then that (token, head)'s fp32 scale in the last 4 bytes, like GGML's q8_0 blocks. Keeping the
scale inside the row means every block operation the runner already does (swap to host, copy-on-
write, prefix sharing) moves codes and scales together without knowing about quantization.

Writes quantize the new tokens' K/V (quantize_kv) and scatter them with the kernels' reshape_and_
cache. Reads dequantize only the blocks this step's block tables reference into a compact float
pool and remap the tables onto it (read_blocks), then attention runs unchanged. The kernels'
paged attention reads float pools only; fused dequantize-in-kernel is the GPU follow-up.
"""

from __future__ import annotations

import dataclasses

import torch

from baton.kernels import reshape_and_cache
from baton.kernels.quant import FP8_E4M3_MAX, round_half_away

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SCALE_BYTES = 4


def check_kv_cache_dtype(kind: str, head_dim: int) -> None:
    if kind not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kind!r}")
    if kind != "auto" and head_dim % SCALE_BYTES:
        raise ValueError(f"a quantized KV cache needs head_dim divisible by {SCALE_BYTES}, got {head_dim}")


def pool_layout(kind: str, dtype: torch.dtype, head_dim: int) -> tuple[torch.dtype, int]:
    """(element dtype, last dimension) of a pool row for one KV head."""
    return (dtype, head_dim) if kind == "auto" else (torch.uint8, head_dim + SCALE_BYTES)


def quantize_kv(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., head_dim] float -> packed uint8 [..., head_dim + 4] (codes, then the fp32 scale)."""
    amax = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-8)
    if kind == "int8":
        scale = amax / 127.0
        codes = round_half_away(x.float() / scale).clamp(-127, 127).to(torch.int8)
    else:
        scale = amax / FP8_E4M3_MAX
        codes = (x.float() / scale).to(torch.float8_e4m3fn)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_kv(packed: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    codes, scale = packed[..., :-SCALE_BYTES], packed[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    values = codes.view(torch.int8 if kind == "int8" else torch.float8_e4m3fn).float()
    return (values * scale).to(dtype)


def write_and_read(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, md, kind: str, dtype: torch.dtype
):
    """Quantize-on-write the step's new K/V; return float pools holding just the blocks the step's
    block tables reference, and the metadata with its tables remapped onto them."""
    reshape_and_cache(quantize_kv(k, kind), quantize_kv(v, kind), k_pool, v_pool, md.slot_mapping)
    dev = k_pool.device
    tables = [md.decode_block_tables, md.prefill_block_tables] + [
        torch.tensor(t.block_table, device=dev) for t in md.trees
    ]
    used = torch.unique(torch.cat([t.reshape(-1) for t in tables]).long())
    remap = torch.zeros(k_pool.shape[0], dtype=torch.int32, device=dev)
    remap[used] = torch.arange(used.numel(), dtype=torch.int32, device=dev)
    trees = [
        dataclasses.replace(t, block_table=remap[torch.tensor(t.block_table, device=dev)].tolist()) for t in md.trees
    ]
    md = dataclasses.replace(
        md,
        decode_block_tables=remap[md.decode_block_tables.long()],
        prefill_block_tables=remap[md.prefill_block_tables.long()],
        trees=trees,
    )
    return dequantize_kv(k_pool[used], kind, dtype), dequantize_kv(v_pool[used], kind, dtype), md
