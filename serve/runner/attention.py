"""The paged attention backend the server passes to the shared model.

One step packs every scheduled sequence into a single row of tokens: first the decode rows (one
query each over the cache up to itself: single new tokens, and the rows of short chunks such as
speculative chains), then the prefill chunks. For each layer the backend scatters the new K/V
into the paged pools (slot mapping), then runs paged decode attention for the decode rows and
prefix-aware attention for the chunks, through baton.kernels' dispatch (Triton on CUDA). On CPU
one call of the C++ decode kernel serves both: once its K/V are in the pools, a chunk's token i is
a decode row over its sequence's cache up to itself (a quantized KV cache keeps torch SDPA for the
chunks: its pools hold the chunk's K/V rounded). Speculative token trees are verified last, each node attending
to the cached prefix and its own ancestors: on CPU through the C++ decode kernel with a mask over
the tree's slots, elsewhere (and with a sliding window) torch SDPA with a tree mask (trees are
small). A layer's attention sinks (gpt-oss) and logit soft-cap (Gemma 2/3) go to every one of these
calls (`attention_extras`); the torch tree path then writes the attention out (kernels' attention_math).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from baton.common.model import Attention
from baton.kernels import flash_attn_with_paged_prefix, paged_attention_decode, reshape_and_cache
from baton.kernels.attention_torch import attention_math
from baton.kernels.paged_attention import cpu_kernel_fits, paged_attention_decode_cpu
from baton.serve.quantization.kv_cache import write_and_read


@dataclass
class TreeGroup:
    """One sequence's speculative token tree, verified in one pass (SpecInfer / Medusa). The model
    runner builds it with serve/speculative/tree.py; the decoder (serve/speculative/decoder.py) reads the result."""

    row: int  # first row (the last real token, the root) in the packed batch
    size: int  # root + proposals
    block_table: list[int]
    prefix_len: int  # tokens cached before the root
    depth: list[int]  # per row; root 0
    mask: torch.Tensor  # [size, size] bool: each node sees itself and its ancestors


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes in the pools
    num_decodes: int  # the first num_decodes tokens are decode rows (one query over the cache each)
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, including the new token
    prefill_cu_seqlens: torch.Tensor  # [num_prefills + 1] int32 offsets of the chunks after the decodes
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_prefix_lens: torch.Tensor  # [num_prefills] int32: tokens already cached before the chunk
    max_prefill_len: int
    window_in_cache: bool = True  # False for StreamingLLM: the cache itself is the window
    trees: list[TreeGroup] = field(default_factory=list)
    # KV groups (serve/scheduling/window_blocks.py): the sliding-window layers' own slot mapping and
    # block tables, otherwise this metadata; None: every layer reads these
    window: AttentionMetadata | None = None

    @property
    def num_prefills(self) -> int:
        return self.prefill_prefix_lens.numel()

    @functools.cached_property
    def tree_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every tree node as a decode row over its sequence's cache (prefix + the whole tree, which
        is written before attention), with a tail mask that shows it only its ancestors and itself:
        (packed rows, block tables, context lengths, tail mask [nodes, largest tree]). Built once a step."""
        dev = self.slot_mapping.device
        width = max(len(t.block_table) for t in self.trees)
        tail_len = max(t.size for t in self.trees)
        rows, tables, lens, masks = [], [], [], []
        for t in self.trees:
            rows += range(t.row, t.row + t.size)
            tables += [t.block_table + [0] * (width - len(t.block_table))] * t.size
            lens += [t.prefix_len + t.size] * t.size
            pad = torch.ones(t.size, tail_len - t.size, dtype=torch.bool)  # prefix tokens: visible
            masks.append(torch.cat([pad, t.mask.cpu()], 1))
        return (
            torch.tensor(rows, device=dev),
            torch.tensor(tables, dtype=torch.int32, device=dev),
            torch.tensor(lens, dtype=torch.int32, device=dev),
            torch.cat(masks).to(dev),
        )

    @functools.cached_property
    def rows_over_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows, then every prefill chunk's tokens, each as one query over its sequence's
        cache up to and including itself: (block tables [rows, width], context lengths [rows]). Once
        a chunk's K/V are in the pools, causal attention of its token i is decode attention over
        prefix + i + 1 tokens, so on CPU the C++ decode kernel serves a step's rows in one call: 1.7-4.6x
        faster than torch SDPA chunk by chunk at prompts of 16-160 tokens (docs/benchmarks.md,
        "Prefill attention"). Built once a step."""
        cu = self.prefill_cu_seqlens.long()
        chunk = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1])
        offset = torch.arange(chunk.numel(), device=cu.device) - cu[chunk]
        lens = self.prefill_prefix_lens.long()[chunk] + offset + 1
        dec, pre = self.decode_block_tables, self.prefill_block_tables[chunk]
        width = max(dec.shape[1], pre.shape[1])
        pad = torch.nn.functional.pad
        tables = torch.cat([pad(dec, (0, width - dec.shape[1])), pad(pre, (0, width - pre.shape[1]))])
        return tables.to(torch.int32), torch.cat([self.decode_context_lens.long(), lens]).to(torch.int32)


def attention_extras(layer) -> dict:
    """The layer's attention sinks ([Hq] or None) and logit soft-cap (0.0: off), as kernel keywords."""
    return {"sinks": getattr(layer, "sinks", None), "softcap": getattr(layer, "logit_softcap", None) or 0.0}


class PagedAttention:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kv_cache_dtype: str = "auto"):
        self.kv_caches = kv_caches
        self.kv_cache_dtype = kv_cache_dtype  # "int8"/"fp8": packed quantized pools (quantization/kv_cache.py)
        self.metadata: AttentionMetadata | None = None
        # Set per step by the runner: at layer query_rows_layer, answer only these rows (the sampled ones).
        self.query_rows: torch.Tensor | None = None
        self.query_rows_layer = -1

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention) -> torch.Tensor:
        md = self.metadata
        assert md is not None and q.shape[0] == 1, "the runner packs a step into one row and sets metadata"
        if md.window is not None and layer.sliding_window is not None:  # its KV group's blocks
            md = md.window
        q, k, v = q[0], k[0], v[0]
        k_cache, v_cache = self.kv_caches[layer.layer_idx]
        if self.kv_cache_dtype == "auto":
            reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping)
        else:  # quantize on write; attend over the blocks this step reads, dequantized
            k_cache, v_cache, md = write_and_read(k, v, k_cache, v_cache, md, self.kv_cache_dtype, q.dtype)
        window = layer.sliding_window if md.window_in_cache else None
        extra = attention_extras(layer)
        if self.query_rows is not None and layer.layer_idx == self.query_rows_layer:
            return self._answer_rows(q, k_cache, v_cache, md, layer.scaling, window, extra)
        out = torch.empty_like(q)
        nd = md.num_decodes
        if md.trees and window is None and cpu_kernel_fits(q, k_cache, v_cache):  # all trees in one call
            rows, tables, lens, tail = md.tree_rows
            out[rows] = paged_attention_decode_cpu(
                q[rows], k_cache, v_cache, tables, lens, softmax_scale=layer.scaling, tail_mask=tail, **extra
            )
        else:
            for tree in md.trees:
                r = slice(tree.row, tree.row + tree.size)
                out[r] = tree_attention(q[r], k[r], v[r], k_cache, v_cache, tree, layer.scaling, window, **extra)
        if md.num_prefills and self.kv_cache_dtype == "auto" and cpu_kernel_fits(q, k_cache, v_cache):
            tables, lens = md.rows_over_cache  # decode rows and chunks in one call (the chunks' K/V are written)
            n = lens.numel()
            rows = paged_attention_decode_cpu(
                q[:n], k_cache, v_cache, tables, lens, softmax_scale=layer.scaling, sliding_window=window, **extra
            )
            if n == q.shape[0]:
                return rows.unsqueeze(0)
            out[:n] = rows
            return out.unsqueeze(0)
        if nd:
            out[:nd] = paged_attention_decode(
                q[:nd],
                k_cache,
                v_cache,
                md.decode_block_tables,
                md.decode_context_lens,
                softmax_scale=layer.scaling,
                sliding_window=window,
                **extra,
            )
        if md.num_prefills:
            end = nd + int(md.prefill_cu_seqlens[-1])
            out[nd:end] = flash_attn_with_paged_prefix(
                q[nd:end],
                k[nd:end],
                v[nd:end],
                md.prefill_cu_seqlens,
                k_cache,
                v_cache,
                md.prefill_block_tables,
                md.prefill_prefix_lens,
                md.max_prefill_len,
                causal=True,
                sliding_window=window,
                softmax_scale=layer.scaling,
                **extra,
            )
        return out.unsqueeze(0)

    def _answer_rows(
        self, q, k_cache, v_cache, md: AttentionMetadata, scale: float, window: int | None, extra: dict | None = None
    ):
        """The query_rows alone, each a decode row over its sequence's cache up to itself (every
        row's K/V is written): [1, rows, Hq, D]. The runner asks this at the last layer of a step
        with prefill chunks, whose other rows would only feed outputs nobody reads (model_runner.py)."""
        tables, lens = md.rows_over_cache
        r = self.query_rows
        out = paged_attention_decode(
            q[r], k_cache, v_cache, tables[r], lens[r], softmax_scale=scale, sliding_window=window, **(extra or {})
        )
        return out.unsqueeze(0)


def tree_attention(
    q, k, v, k_cache, v_cache, tree: TreeGroup, scale: float, window: int | None, sinks=None, softcap=0.0
) -> torch.Tensor:
    """Tree nodes attend to the cached prefix and to their own ancestors (torch path); sinks [Hq] and
    softcap > 0 (attention sinks, logit soft-capping) take the explicit attention_math core."""
    blocks = torch.tensor(tree.block_table, device=q.device)
    kp = k_cache[blocks].flatten(0, 1)[: tree.prefix_len]
    vp = v_cache[blocks].flatten(0, 1)[: tree.prefix_len]
    keys, vals = torch.cat([kp, k]), torch.cat([vp, v])
    mask = torch.cat(
        [torch.ones(tree.size, tree.prefix_len, dtype=torch.bool, device=q.device), tree.mask.to(q.device)], 1
    )
    if window is not None:
        depth = torch.tensor(tree.depth, device=q.device)
        q_idx = tree.prefix_len + depth
        k_idx = torch.cat([torch.arange(tree.prefix_len, device=q.device), tree.prefix_len + depth])
        mask &= (q_idx[:, None] - k_idx[None, :]) < window
    qt, kt, vt = q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1)
    if sinks is not None or softcap:
        out = attention_math(qt[None], kt[None], vt[None], scale, mask, sinks, softcap)[0]
    else:
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
