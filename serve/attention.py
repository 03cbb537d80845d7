"""The paged attention backend the server passes to the shared model.

One step packs every scheduled sequence into a single row of tokens: first the decodes (one new
token each), then the prefill chunks. For each layer the backend scatters the new K/V into the
paged pools (slot mapping), then runs paged decode attention for the decodes and prefix-aware
attention for the chunks, through baton.kernels' dispatch (Triton on CUDA, torch on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.common.model import Attention
from baton.kernels import flash_attn_with_paged_prefix, paged_attention_decode, reshape_and_cache


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes in the pools
    num_decodes: int  # the first num_decodes tokens are single-token decodes
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, including the new token
    prefill_cu_seqlens: torch.Tensor  # [num_prefills + 1] int32 offsets of the chunks after the decodes
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_prefix_lens: torch.Tensor  # [num_prefills] int32: tokens already cached before the chunk
    max_prefill_len: int
    window_in_cache: bool = True  # False for StreamingLLM: the cache itself is the window

    @property
    def num_prefills(self) -> int:
        return self.prefill_prefix_lens.numel()


class PagedAttention:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.kv_caches = kv_caches
        self.metadata: AttentionMetadata | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention) -> torch.Tensor:
        md = self.metadata
        assert md is not None and q.shape[0] == 1, "the runner packs a step into one row and sets metadata"
        q, k, v = q[0], k[0], v[0]
        k_cache, v_cache = self.kv_caches[layer.layer_idx]
        reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping)
        window = layer.sliding_window if md.window_in_cache else None
        out = torch.empty_like(q)
        nd = md.num_decodes
        if nd:
            out[:nd] = paged_attention_decode(q[:nd], k_cache, v_cache, md.decode_block_tables, md.decode_context_lens,
                                              softmax_scale=layer.scaling, sliding_window=window)
        if md.num_prefills:
            out[nd:] = flash_attn_with_paged_prefix(q[nd:], k[nd:], v[nd:], md.prefill_cu_seqlens, k_cache, v_cache,
                                                    md.prefill_block_tables, md.prefill_prefix_lens, md.max_prefill_len,
                                                    causal=True, sliding_window=window, softmax_scale=layer.scaling)
        return out.unsqueeze(0)
