"""Baton (HF names) <-> megatron-core GPTModel state dicts, pure torch: slicing and concatenation only,
so a round trip is bit-exact and needs no megatron-core install.

The layout, as megatron-core 0.16.1's GPTModel holds it (local spec; the TE spec moves the two
pre-norms into linear_qkv.layer_norm_weight / linear_fc1.layer_norm_weight):
- linear_qkv rows are interleaved per query group: [q_1..q_n, k, v] for each KV head (Qwen2's
  biases the same way). Column parallel: rank r holds the r-th contiguous row block, i.e. whole
  query groups; with fewer KV groups than TP ranks the block is part of one group and megatron
  all-gathers the fused output and picks its slice (attention.py), so no KV head is replicated.
- linear_fc1 is [gate; up]; rank r holds [gate_r; up_r] (each half sharded on its own - slicing
  the fused tensor as one block gives the right shapes and garbage output).
- linear_proj and linear_fc2 are row parallel: split on the input dim.
- The vocab is padded to a multiple of make_vocab_size_divisible_by * tp (zero rows) and split over
  TP; with tied embeddings the last PP stage holds a copy of the embedding as output_layer.weight.
- Every (pipeline stage, virtual stage) chunk numbers its layers from 0; chunk (p, v) holds global
  layers starting at v * L/vp + p * L/(pp*vp) (megatron's interleaved assignment).
- Qwen3's per-head q/k RMSNorms are megatron's qk_layernorm (self_attention.q_layernorm /
  k_layernorm, [head_dim], replicated over TP, applied before the rope as Qwen3 does). What else the
  2025-26 families add (megatron_gaps) GPTModel cannot express: they are refused, naming the family.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from baton.common.config import ConfigError, ModelConfig

Tensor = torch.Tensor
SPECS = ("local", "te")


# ------------------------------------------------------------------------------------ layout
def padded_vocab_size(vocab_size: int, tp_size: int = 1, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's padded vocab: a multiple of make_vocab_size_divisible_by * tp."""
    if make_vocab_size_divisible_by < 1 or tp_size < 1:
        raise ConfigError(f"make_vocab_size_divisible_by ({make_vocab_size_divisible_by}) and tp must be >= 1")
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def layer_range(num_layers: int, pp_size: int = 1, pp_rank: int = 0, vp_size: int = 1, vp_rank: int = 0) -> range:
    """Global indices of the layers in pipeline chunk (pp_rank, vp_rank), in local order."""
    if num_layers % (pp_size * vp_size):
        raise ConfigError(
            f"num_hidden_layers ({num_layers}) must divide evenly into pp*vp ({pp_size}*{vp_size}) chunks"
        )
    per_chunk = num_layers // (pp_size * vp_size)
    start = vp_rank * (num_layers // vp_size) + pp_rank * per_chunk
    return range(start, start + per_chunk)


# What GPTModel (as Baton builds it: pre-norm RMSNorm layers, a gated MLP) lacks, per ModelConfig feature.
_GAPS = (
    (lambda c: c.norm_layout == "sandwich", "sandwich norms (after attention and the MLP as well as before)"),
    (lambda c: c.norm_layout == "post", "post-norm layers (norms on each block's output, not its input)"),
    (lambda c: c.qk_norm == "full", "full-width q/k RMSNorms (its qk_layernorm is per head)"),
    (lambda c: bool(c.norm_weight_offset), "(offset + w) RMSNorm weights"),
    (lambda c: c.scale_embeddings, "sqrt(hidden_size)-scaled embeddings"),
    (lambda c: c.hidden_act != "silu", "GeGLU MLP"),
    (lambda c: c.query_pre_attn_scalar is not None, "query_pre_attn_scalar softmax scale"),
    (lambda c: c.attn_logit_softcapping is not None, "soft-capped attention scores"),
    (lambda c: c.final_logit_softcapping is not None, "soft-capped final logits"),
    (lambda c: c.attention_sinks, "attention sinks"),
    (lambda c: c.sliding_rope_theta is not None, "second rope for the sliding layers"),
    (lambda c: c.swiglu_alpha is not None, "clamped-SwiGLU experts with biases"),
)


def megatron_gaps(cfg: ModelConfig) -> list[str]:
    """The features of `cfg` that megatron-core's GPTModel, as Baton lays it out, cannot hold."""
    return [what for has, what in _GAPS if has(cfg)]


def check_family(cfg: ModelConfig, need) -> None:
    """Refuse a family GPTModel cannot express, naming it and what is missing."""
    gaps = megatron_gaps(cfg)
    need(
        not gaps,
        f"model_type {cfg.model_type!r}: megatron-core's GPTModel has no {', no '.join(gaps)} "
        "(train it with backend torch, torch3d or deepspeed)",
    )


def check_layout(cfg: ModelConfig, tp_size: int, pp_size: int = 1, vp_size: int = 1) -> None:
    """Refuse what megatron-core's GPTModel cannot hold, before any tensor is touched."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(f"megatron layout: {msg}")

    need(tp_size >= 1 and pp_size >= 1 and vp_size >= 1, "tp, pp and vp sizes must be >= 1")
    check_family(cfg, need)
    need(cfg.num_local_experts == 0, "MoE (num_local_experts > 0) is not supported by this converter")
    need(
        not cfg.attention_bias,
        "attention_bias (Llama's o_proj bias) has no megatron-core equivalent: add_bias_linear would "
        "also add fc1/fc2 biases",
    )
    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    need(heads % tp_size == 0, f"num_attention_heads ({heads}) must be divisible by tp ({tp_size})")
    need(
        groups % tp_size == 0 or tp_size % groups == 0,
        f"num_key_value_heads ({groups}) and tp ({tp_size}) must divide one another",
    )
    rows = (heads + 2 * groups) * cfg.head_dim
    need(rows % tp_size == 0, f"the fused qkv rows ({rows}) must be divisible by tp ({tp_size})")
    need(cfg.intermediate_size % tp_size == 0, f"intermediate_size ({cfg.intermediate_size}) must be divisible by tp")
    layer_range(cfg.num_hidden_layers, pp_size, 0, vp_size, 0)


def _names(spec: str, cfg: ModelConfig) -> dict[str, str]:
    """Baton's -> megatron's names of a layer's tensors that every TP rank holds whole."""
    if spec not in SPECS:
        raise ConfigError(f"megatron spec must be one of {SPECS}, got {spec!r}")
    te = spec == "te"
    names = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight",
        "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight",
    }
    if cfg.qk_norm == "head":  # (the same names in both specs)
        names["self_attn.q_norm.weight"] = "self_attention.q_layernorm.weight"
        names["self_attn.k_norm.weight"] = "self_attention.k_layernorm.weight"
    return names


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    """[all q; all k; all v] -> per query group [q_1..q_n, k, v] (weights [out, in] or biases [out])."""
    g, d = cfg.num_key_value_heads, cfg.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    g, d = cfg.num_key_value_heads, cfg.head_dim
    n = cfg.num_attention_heads // g
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (n + 2) * d, *rest).split([n * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


# ------------------------------------------------------------------------- baton -> megatron
def baton_to_megatron(
    state_dict: Mapping[str, Tensor],
    cfg: ModelConfig,
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    vp_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
    vp_rank: int = 0,
    spec: str = "local",
) -> dict[str, Tensor]:
    """The state dict of GPTModel chunk (tp_rank, pp_rank, vp_rank), weights only: the modules'
    `_extra_state` entries (None for the local spec) are not in it, so load with strict=False and
    check that only those are missing. Build the model with padded_vocab_size(...) as vocab_size."""
    check_layout(cfg, tp_size, pp_size, vp_size)
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size and 0 <= vp_rank < vp_size):
        raise ConfigError(f"rank (tp {tp_rank}, pp {pp_rank}, vp {vp_rank}) outside the layout")
    names = _names(spec, cfg)
    sd = dict(state_dict)
    out: dict[str, Tensor] = {}

    def col(t: Tensor) -> Tensor:  # column parallel: a contiguous row block per rank
        return t.chunk(tp_size, dim=0)[tp_rank].contiguous()

    def row(t: Tensor) -> Tensor:  # row parallel: a block of input columns per rank
        return t.chunk(tp_size, dim=1)[tp_rank].contiguous()

    first = pp_rank == 0 and vp_rank == 0
    last = pp_rank == pp_size - 1 and vp_rank == vp_size - 1
    vocab = padded_vocab_size(cfg.vocab_size, tp_size, make_vocab_size_divisible_by)
    embed = sd["model.embed_tokens.weight"]
    if first:
        out["embedding.word_embeddings.weight"] = col(_pad_rows(embed, vocab))
    for local, i in enumerate(layer_range(cfg.num_hidden_layers, pp_size, pp_rank, vp_size, vp_rank)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
        a = src + "self_attn."
        for ours, theirs in names.items():
            out[dst + theirs] = sd[src + ours]
        out[dst + "self_attention.linear_qkv.weight"] = col(
            _fuse_qkv(sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"], cfg)
        )
        if cfg.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = col(
                _fuse_qkv(sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"], cfg)
            )
        out[dst + "self_attention.linear_proj.weight"] = row(sd[a + "o_proj.weight"])
        gate, up = sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([col(gate), col(up)])
        out[dst + "mlp.linear_fc2.weight"] = row(sd[src + "mlp.down_proj.weight"])
    if last:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
        if not cfg.tie_word_embeddings:
            out["output_layer.weight"] = col(_pad_rows(sd["lm_head.weight"], vocab))
        elif not first:  # tied across stages: the last stage keeps its own copy
            out["output_layer.weight"] = col(_pad_rows(embed, vocab))
    return out


# ------------------------------------------------------------------------- megatron -> baton
ShardKey = tuple[int, ...]  # (tp_rank, pp_rank) or (tp_rank, pp_rank, vp_rank)


def megatron_to_baton(
    shards: Mapping[ShardKey, Mapping[str, Tensor]] | Mapping[str, Tensor],
    cfg: ModelConfig,
    spec: str = "local",
) -> dict[str, Tensor]:
    """Merge GPTModel chunk state dicts keyed (tp_rank, pp_rank[, vp_rank]) - or one TP=PP=1 state
    dict - into Baton's checkpoint state dict (vocab padding dropped, tied lm_head omitted)."""
    if all(isinstance(k, str) for k in shards):
        shards = {(0, 0, 0): shards}  # type: ignore[dict-item]
    chunks = {tuple(k) + (0,) * (3 - len(k)): v for k, v in shards.items()}  # type: ignore[arg-type]
    tp_size, pp_size, vp_size = (max(k[j] for k in chunks) + 1 for j in range(3))
    missing = [
        (t, p, v) for t in range(tp_size) for p in range(pp_size) for v in range(vp_size) if (t, p, v) not in chunks
    ]
    if missing or len(chunks) != tp_size * pp_size * vp_size:
        raise ValueError(f"megatron shards: missing chunk (tp, pp, vp) = {missing[0] if missing else '?'}")
    check_layout(cfg, tp_size, pp_size, vp_size)
    names = {v: k for k, v in _names(spec, cfg).items()}

    used: set[tuple[int, int, str]] = set()

    def get(key: str, p: int, v: int) -> list[Tensor]:
        used.add((p, v, key))
        try:
            return [chunks[(t, p, v)][key] for t in range(tp_size)]
        except KeyError:
            raise ValueError(f"megatron shards: chunk (pp {p}, vp {v}) has no {key!r}") from None

    def col(key: str, p: int = 0, v: int = 0) -> Tensor:
        return torch.cat(get(key, p, v), dim=0)

    def row(key: str, p: int, v: int) -> Tensor:
        return torch.cat(get(key, p, v), dim=1)

    last_p, last_v = pp_size - 1, vp_size - 1
    out: dict[str, Tensor] = {}
    embed = col("embedding.word_embeddings.weight")[: cfg.vocab_size]
    out["model.embed_tokens.weight"] = embed
    for p in range(pp_size):
        for v in range(vp_size):
            for local, i in enumerate(layer_range(cfg.num_hidden_layers, pp_size, p, vp_size, v)):
                src, dst = f"decoder.layers.{local}.", f"model.layers.{i}."
                for theirs, ours in names.items():
                    out[dst + ours] = get(src + theirs, p, v)[0]
                a = dst + "self_attn."
                qkv = _split_qkv(col(src + "self_attention.linear_qkv.weight", p, v), cfg)
                out.update(zip((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), qkv))
                if cfg.qkv_bias:
                    qkv = _split_qkv(col(src + "self_attention.linear_qkv.bias", p, v), cfg)
                    out.update(zip((a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), qkv))
                out[a + "o_proj.weight"] = row(src + "self_attention.linear_proj.weight", p, v)
                halves = [t.chunk(2, dim=0) for t in get(src + "mlp.linear_fc1.weight", p, v)]
                out[dst + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
                out[dst + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
                out[dst + "mlp.down_proj.weight"] = row(src + "mlp.linear_fc2.weight", p, v)
    out["model.norm.weight"] = get("decoder.final_layernorm.weight", last_p, last_v)[0]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = col("output_layer.weight", last_p, last_v)[: cfg.vocab_size]
    elif pp_size * vp_size > 1 and "output_layer.weight" in chunks[(0, last_p, last_v)]:
        copy = col("output_layer.weight", last_p, last_v)[: cfg.vocab_size]
        if not torch.equal(copy, embed):
            raise ValueError("tied embeddings: the last stage's output_layer copy differs from the embedding")
    for (t, p, v), chunk in chunks.items():  # a tensor this config does not describe would be lost
        extra = sorted(k for k in chunk if (p, v, k) not in used and not k.endswith("_extra_state"))
        if extra:
            raise ValueError(
                f"megatron shards: chunk (tp {t}, pp {p}, vp {v}) has {extra[0]!r}, which the config does not describe"
            )
    return {k: t.contiguous() for k, t in out.items()}


# ------------------------------------------------------------------ dist_checkpointing layout
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def to_dist_layout(
    state_dict: Mapping[str, Tensor], cfg: ModelConfig, tp_size: int = 1, make_vocab_size_divisible_by: int = 128
) -> dict[str, Tensor]:
    """The global tensors of a megatron-core dist checkpoint (what GPTModel.sharded_state_dict
    names): TE-spec names whatever the spec, each layer parameter stacked as [num_layers, ...], vocab
    padded for a run at `tp_size`, tied embeddings stored once. Independent of the TP/PP layout."""
    flat = baton_to_megatron(state_dict, cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by, spec="te")
    if tp_size > 1:  # only the padding depends on the run's TP
        vocab = padded_vocab_size(cfg.vocab_size, tp_size, make_vocab_size_divisible_by)
        for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if key in flat:
                flat[key] = _pad_rows(flat[key][: cfg.vocab_size], vocab)
    out, layers = {}, {}
    for key, t in flat.items():
        m = _LAYER.match(key)
        if m:
            layers.setdefault(m.group(2), []).append(t)
        else:
            out[key] = t
    out.update({f"decoder.layers.{name}": torch.stack(ts) for name, ts in layers.items()})
    return out


def from_dist_layout(tensors: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Baton's state dict from a dist checkpoint's global tensors (the inverse of to_dist_layout)."""
    flat: dict[str, Tensor] = {}
    for key, t in tensors.items():
        if key.startswith("decoder.layers."):
            if t.shape[0] != cfg.num_hidden_layers:
                raise ValueError(f"{key!r} stacks {t.shape[0]} layers, config has {cfg.num_hidden_layers}")
            name = key.removeprefix("decoder.layers.")
            flat.update({f"decoder.layers.{i}.{name}": t[i] for i in range(t.shape[0])})
        else:
            flat[key] = t
    return megatron_to_baton(flat, cfg, spec="te")
