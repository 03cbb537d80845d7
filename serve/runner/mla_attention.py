"""The latent-only paged cache of multi-head latent attention (DeepSeek-V2/V3) and its backend.

An MLA layer (common/mla.py) compresses each token's keys and values into one latent of kv_lora_rank
values (after kv_a_layernorm) plus one rotated rope key of qk_rope_head_dim shared by every head; the
per-head K and V are kv_b_proj's decompression of that latent. So the cache keeps exactly that: ONE
pool per layer, [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (latent first), instead of
a K and a V pool of heads x head_dim - DeepSeek-V3's 576 values a token a layer against 2 x 128 x
128 for its heads uncompressed. Block ops (swaps, copy-on-write, slot moves) move that one tensor.

Attention over it, weight absorption (DeepSeek-V2 sec. 2.1.2, vLLM's MLA backends): kv_b_proj's key
half W_UK folds into the query, q_lat[h] = q_nope[h] @ W_UK[h], so a score is q_lat . latent +
q_pe . k_pe over the cached rows as they are, and its value half W_UV is applied after the softmax,
out[h] = (softmax @ latent)[h] @ W_UV[h]^T. Every head then attends over the same single cache row:
multi-query attention with one (L + R)-wide head, which the paged MLA decode kernel
(kernels/mla_decode.py) computes. Decode rows go through it, so do the rows of short prefill chunks
(each a decode row over its sequence's cache up to itself once the chunk's latents are written:
AttentionMetadata.rows_over_cache), speculative trees with their ancestor mask, and at the last layer
the rows the runner samples (query_rows).

Prefill chunks of DECOMPRESS_FROM tokens or more attend in the naive form, as vLLM's MLA prefill
does: the blocks their sequences read are decompressed through the layer's own kv_b_proj into
per-head K/V (once per step, not once per row), then prefix-aware prefill attention, whose per-pair
cost is H x (qk_nope + qk_rope + v) instead of H x (2 L + R). The backend's `form="decompress"` runs
every row that way (decode rows as paged decode over the decompressed blocks): the reference the
absorbed form is checked and measured against (benchmarks/mla_serving.py), whose decode cost grows
with context x kv_lora_rank x heads x (qk_nope + v) per step where the absorbed form reads the
latents once.
"""

from __future__ import annotations

import itertools

import torch
from baton.common.config import ModelConfig
from baton.common.mla import MLAttention
from baton.kernels import flash_attn_with_paged_prefix, paged_attention_decode
from baton.kernels.attention_torch import attention_math
from baton.kernels.mla_decode import mla_cache_write, paged_mla_decode
from baton.serve.runner.attention import AttentionMetadata, TreeGroup
from torch import nn

FORMS = ("absorbed", "decompress")
# Chunks this long or longer attend decompressed (prefix-aware prefill over per-head K/V), shorter
# ones and decode rows absorbed: on CPU (benchmarks/mla_serving.py, DeepSeek-V3's head shapes) a
# 256-token chunk ran 1.02-1.3x faster decompressed and a 512-token one up to 2.2x after an 8k prefix,
# while a 128-token chunk after 2k ran 1.3x slower and a 64-token one after 4k 1.9x slower.
DECOMPRESS_FROM = 256


def latent_width(cfg: ModelConfig) -> int:
    """Values cached per token per MLA layer: the latent, then the rope key."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def absorbed_weights(attn: MLAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, qk_nope, L], W_UV^T [H, L, v_head_dim]) of an MLA layer, contiguous copies for
    batched matmuls over heads, kept on the module (`absorbed`): the runner takes them for every MLA
    module of the model (the MTP blocks' too, which the MTP proposer reads) before it packs its
    linears, after which kv_b_proj has no plain weight. A quantized kv_b_proj is dequantized once."""
    if "absorbed" in attn.__dict__:
        return attn.__dict__["absorbed"]
    proj = attn.kv_b_proj
    if hasattr(proj, "dequantize"):
        h, nope, v = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
        w = proj.dequantize().view(h, nope + v, attn.kv_lora_rank)
        uk, uv = w[:, :nope], w[:, nope:]
    else:
        uk, uv = attn.w_uk(), attn.w_uv()
    attn.__dict__["absorbed"] = uk.detach().contiguous(), uv.detach().transpose(1, 2).contiguous()
    return attn.__dict__["absorbed"]


class LatentPagedAttention:
    """The runner's attention backend for a model of MLA layers: `mla` per layer (the latent cache),
    set up per step like PagedAttention (metadata, query_rows)."""

    kv_cache_dtype = "auto"  # (rules.py refuses a quantized cache for MLA)

    def __init__(self, kv_caches: list[tuple[torch.Tensor, ...] | None], form: str = "absorbed"):
        if form not in FORMS:
            raise ValueError(f"MLA form must be one of {FORMS}, got {form!r}")
        self.kv_caches, self.form = kv_caches, form
        self.metadata: AttentionMetadata | None = None
        self.query_rows: torch.Tensor | None = None
        self.query_rows_layer = -1

    def __call__(self, q, k, v, layer: MLAttention) -> torch.Tensor:
        raise TypeError(
            f"layer {layer.layer_idx}: the latent cache holds no per-head K/V; an MLA layer attends through attn.mla"
        )

    def mla(self, q_nope, q_pe, latent, k_pe, layer: MLAttention) -> torch.Tensor:
        """q_nope [1, T, H, nope], q_pe [1, T, H, R] (rotated), latent [1, T, L], k_pe [1, T, R]
        -> [1, T', H, v_head_dim]: the step's latents written, then each row's attention."""
        md = self.metadata
        assert md is not None and q_nope.shape[0] == 1, "the runner packs a step into one row and sets metadata"
        cache = self.kv_caches[layer.layer_idx][0]
        mla_cache_write(latent[0], k_pe[0], cache, md.slot_mapping)
        qn, qp = q_nope[0], q_pe[0]
        if self.query_rows is not None and layer.layer_idx == self.query_rows_layer:
            tables, lens = md.rows_over_cache
            r = self.query_rows
            return self._rows(qn[r], qp[r], cache, tables[r], lens[r], layer).unsqueeze(0)
        out = qn.new_empty(qn.shape[0], qn.shape[1], layer.v_head_dim)
        for tree in md.trees:
            r = slice(tree.row, tree.row + tree.size)
            out[r] = self._tree(qn[r], qp[r], cache, tree, layer)
        if md.num_prefills:
            tables, lens = md.rows_over_cache
        else:
            tables, lens = md.decode_block_tables, md.decode_context_lens
        n = lens.numel()
        if n:
            rows = self._rows(qn[:n], qp[:n], cache, tables, lens, layer, md)
            if n == qn.shape[0]:
                return rows.unsqueeze(0)
            out[:n] = rows
        return out.unsqueeze(0)

    # ------------------------------------------------------------------------------ the two forms
    def _rows(self, qn, qp, cache, tables, lens, layer, md: AttentionMetadata | None = None) -> torch.Tensor:
        """[T, H, v] for rows each over its sequence's cache up to itself (lens). Given the step's
        metadata `md` the rows are its decode rows, then its chunks: chunks of DECOMPRESS_FROM tokens
        or more (every chunk in the naive form) attend decompressed, as prefill."""
        naive = self.form == "decompress"
        nd = md.num_decodes if md is not None and md.num_prefills else qn.shape[0]
        cu = md.prefill_cu_seqlens.tolist() if nd < qn.shape[0] else [0]
        long = [c for c in range(len(cu) - 1) if naive or cu[c + 1] - cu[c] >= DECOMPRESS_FROM]
        short = self._decoded if naive else self._absorbed
        if not long:
            return short(qn, qp, cache, tables, lens, layer)
        rows = torch.cat([torch.arange(nd + cu[c], nd + cu[c + 1]) for c in long]).to(qn.device)
        rest = torch.ones(qn.shape[0], dtype=torch.bool, device=qn.device)
        rest[rows] = False
        out = qn.new_empty(*qn.shape[:2], layer.v_head_dim)
        if bool(rest.any()):
            out[rest] = short(qn[rest], qp[rest], cache, tables[rest], lens[rest], layer)
        sizes = [cu[c + 1] - cu[c] for c in long]
        chunk_cu = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int32, device=qn.device)
        prefix = md.prefill_prefix_lens[torch.tensor(long, device=qn.device)]
        out[rows] = self._prefill(
            qn[rows], qp[rows], cache, tables[rows], lens[rows], layer, chunk_cu, prefix, max(sizes)
        )
        return out

    def _absorbed(self, qn, qp, cache, tables, lens, layer) -> torch.Tensor:
        q = torch.cat([self._absorb_query(qn, layer), qp], -1)
        o = paged_mla_decode(q, cache, tables, lens, layer.scaling, layer.kv_lora_rank)
        return self._up(o, layer)

    def _absorb_query(self, qn: torch.Tensor, layer) -> torch.Tensor:
        """q_lat [T, H, L] = q_nope[h] @ W_UK[h] per head."""
        return torch.bmm(qn.transpose(0, 1), absorbed_weights(layer)[0]).transpose(0, 1)

    def _up(self, o_lat: torch.Tensor, layer) -> torch.Tensor:
        """[T, H, v] = o_lat[h] @ W_UV[h]^T per head."""
        return torch.bmm(o_lat.transpose(0, 1), absorbed_weights(layer)[1]).transpose(0, 1)

    def _tree(self, qn, qp, cache, tree: TreeGroup, layer) -> torch.Tensor:
        """A speculative tree's nodes, absorbed, over the cached prefix and their own ancestors
        (written to the cache before attention, at the tree's slots): one MQA call with a mask."""
        q = torch.cat([self._absorb_query(qn, layer), qp], -1)
        blocks = torch.tensor(tree.block_table, device=q.device)
        rows = cache[blocks].flatten(0, 1)[: tree.prefix_len + tree.size]
        seen = torch.ones(tree.size, tree.prefix_len, dtype=torch.bool, device=q.device)
        mask = torch.cat([seen, tree.mask.to(q.device)], 1)
        kv = rows.view(1, 1, *rows.shape)
        o = attention_math(q.transpose(0, 1).unsqueeze(0), kv, kv, layer.scaling, mask)[0]
        return self._up(o.transpose(0, 1)[..., : layer.kv_lora_rank], layer)

    @staticmethod
    def _decompress(qn, qp, cache, tables, layer):
        """The naive form's inputs: q = [q_nope, q_pe], and the blocks `tables` read decompressed by
        kv_b_proj into per-head K/V pools ([n, block_size, H, D]: k = [k_nope, k_pe], v), with the
        tables remapped onto them; q/k/v zero-padded to one width (zero columns change nothing)."""
        h, nope, v_dim, lr = qn.shape[1], layer.qk_nope_head_dim, layer.v_head_dim, layer.kv_lora_rank
        used, local = torch.unique(tables, return_inverse=True)
        rows = cache[used.long()]  # [n, block_size, L + R]
        kv = layer.kv_b_proj(rows[..., :lr]).view(*rows.shape[:2], h, nope + v_dim)
        k_pe = rows[..., lr:].unsqueeze(2).expand(-1, -1, h, -1)
        k, v = torch.cat([kv[..., :nope], k_pe], -1), kv[..., nope:]
        q = torch.cat([qn, qp], -1)
        width = max(k.shape[-1], v_dim)
        q, k, v = (nn.functional.pad(x, (0, width - x.shape[-1])).contiguous() for x in (q, k, v))
        return q, k, v, local.to(torch.int32)

    def _decoded(self, qn, qp, cache, tables, lens, layer) -> torch.Tensor:
        """The naive form of decode rows: paged decode over the decompressed blocks."""
        q, k, v, local = self._decompress(qn, qp, cache, tables, layer)
        return paged_attention_decode(q, k, v, local, lens, softmax_scale=layer.scaling)[..., : layer.v_head_dim]

    def _prefill(self, qn, qp, cache, tables, lens, layer, cu, prefix_lens, max_len: int) -> torch.Tensor:
        """Chunks (rows packed by `cu`, after `prefix_lens` cached tokens each) decompressed: prefix-aware
        prefill attention over the decompressed blocks, the chunks' own K/V gathered from them."""
        q, k, v, local = self._decompress(qn, qp, cache, tables, layer)
        bs, pos = cache.shape[1], lens.long() - 1
        own = local.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        kf, vf = k.flatten(0, 1), v.flatten(0, 1)
        out = flash_attn_with_paged_prefix(
            q, kf[own], vf[own], cu, k, v, local[cu[:-1].long()], prefix_lens, max_len,
            causal=True, softmax_scale=layer.scaling,
        )  # fmt: skip
        return out[..., : layer.v_head_dim]
