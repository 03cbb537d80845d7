"""shard_model(): one rank's part of the shared model, cut from outside (gpt-fast's `apply_tp`).

Applied to a meta-device model before any weight is read, it swaps modules for their local-size
versions and returns, for every tensor the rank holds, the slice of the checkpoint tensor to read
(serve/parallel/loader.py then reads exactly those bytes from the safetensors files).

Tensor parallelism (Megatron's split, vLLM's names): q/k/v and gate/up are column-parallel (each
rank keeps whole heads / a block of MLP columns), o and down row-parallel with one all-reduce of
their output (the bias is added on rank 0 only, so it is summed once). GQA is split by KV head: a
rank's query heads find their KV heads locally; with fewer KV heads than ranks each KV head is
replicated on the ranks whose query heads use it. The embedding is vocab-parallel (each rank looks
up its vocabulary rows, the partial results are all-reduced) and the LM head column-parallel over
the vocabulary, its logits all-gathered (trimmed of the padding that makes the vocabulary divide).
Routed experts (Mixtral's, Qwen3-MoE's, gpt-oss's stacked ones) are either each split like an MLP
("tensor": gpt-oss's [E, H, 2I] gate/up columns and [E, I, H] down rows, cut along I, the down bias
on rank 0 only) or dealt out whole ("expert"); either way the router is replicated (every rank
routes alike) and the MoE block ends in one all-reduce.

Multi-head latent attention (DeepSeek-V2/V3) splits its heads the same way - the query's and
kv_b_proj's up-projections by head, o_proj by rows - and replicates the compression, so every rank
caches the whole latent (`_shard_mla`). DeepSeekMoE's shared experts are cut like a dense MLP inside
the MoE block's one all-reduce.

The newer families' attention: q/k norms per head (Qwen3, Gemma 3) are replicated, a rank applying
them to its own heads; OLMo 2's norm over the whole q/k projection holds this rank's slice of its
weight and takes the mean of squares over the full width (one all-reduce of the per-row sums: a
replicated KV head is counted once per rank that holds it, in the sum and in the width alike, so
the mean is the same); gpt-oss's sinks are split by query head like q_proj's rows. Soft-capping,
the softmax scale and the per-layer rope need nothing.

Quantized linears are cut the same way: every tensor of a module is [out, ...], so a column split
cuts dim 0 and a row split cuts dim 1 evenly (weights, packed int4 bytes, group scales/zeros alike;
ParallelConfig.check_model keeps whole groups); per-output-channel scales are replicated.

Pipeline parallelism: a rank keeps its stage's layers (the others become empty placeholders, so
names and layer indices stay global), the embedding on the first stage, norm and head on the last.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from baton.common.mla import MLAttention
from baton.common.model import MLP, CausalLM, RMSNorm
from baton.common.moe import GptOssExperts, GptOssMoE, MoE
from baton.serve.parallel.comm import all_gather, all_reduce
from baton.serve.parallel.config import stage_layers
from baton.serve.quantization.linear import FORMATS, QuantLinear
from torch import nn


class Slice(NamedTuple):
    """Rows/columns [start, stop) of a checkpoint tensor along `dim`, zero-padded to `size`."""

    dim: int
    start: int
    stop: int
    size: int


@dataclass(frozen=True)
class Shard:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    moe_parallel: str = "tensor"

    def layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.pp_size, self.pp_rank)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


class Placeholder(nn.Module):
    """A layer or expert another rank holds."""


def _all_reduce_output(group):
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return all_reduce(output, group)

    return hook


def _gather_vocab(group, tp: int, vocab: int):
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return torch.cat(all_gather(output, group, tp), -1)[..., :vocab]

    return hook


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the embedding; ids outside them look up
    zeros, and the all-reduce sums in the rank that has each id."""

    def __init__(self, num_local: int, dim: int, vocab_start: int, group, dtype: torch.dtype):
        super().__init__(num_local, dim, device="meta", dtype=dtype)
        self.vocab_start, self.group = vocab_start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.group)


class ExpertParallelMoE(MoE):
    """The router runs on every rank (it is replicated, so all agree on the routing); each rank
    runs only its own experts, and the all-reduce hook sums their weighted outputs."""

    local_experts: range

    def held_experts(self) -> range:
        return self.local_experts


class ExpertParallelGptOssMoE(ExpertParallelMoE, GptOssMoE):
    """gpt-oss's block with a rank's share of the experts (LocalGptOssExperts)."""


class LocalGptOssExperts(GptOssExperts):
    """Experts [first, first + n) of gpt-oss's stacked tensors: the routing still counts all
    `total` of them (global expert ids), the compute indexes the local stack."""

    first: int
    total: int

    def __len__(self) -> int:
        return self.total

    def grouped(self, xs: torch.Tensor, counts: list[int], experts: range) -> torch.Tensor:
        return super().grouped(xs, counts, range(experts.start - self.first, experts.stop - self.first))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return super().expert(e - self.first, x)


class TensorParallelRMSNorm(RMSNorm):
    """OLMo 2's q/k RMSNorm over the whole projection, on a rank that holds some of the heads: its
    slice of the weight, the mean of squares over `width` channels (the local ones x the ranks),
    their sum all-reduced over the tensor-parallel group."""

    def __init__(self, norm: RMSNorm, local: int, width: int, group):
        super().__init__(local, norm.eps, norm.offset)
        self.weight = nn.Parameter(torch.empty(local, device="meta", dtype=norm.weight.dtype))
        self.width, self.group = width, group

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        assert residual is None, "a q/k norm has no residual"
        xf = x.float()
        squares = all_reduce(xf.pow(2).sum(-1, keepdim=True), self.group)
        out = xf * torch.rsqrt(squares / self.width + self.eps) * (self.offset + self.weight.float())
        return out.to(x.dtype)


def _local_linear(mod: nn.Module, in_features: int, out_features: int, bias: bool) -> nn.Module:
    """A meta module of `mod`'s kind (float or the same quantized format) at local size."""
    with torch.device("meta"):
        if isinstance(mod, QuantLinear):
            new = FORMATS[mod.format](in_features, out_features, bias, mod.group_size)
            new.compute_dtype = mod.compute_dtype
            return new
        return nn.Linear(in_features, out_features, bias=bias, dtype=mod.weight.dtype)


def _tensors(mod: nn.Module) -> list[str]:
    return [
        n
        for n, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
        if t is not None
    ]


class _Cutter:
    def __init__(self, model: CausalLM, shard: Shard, group):
        self.model, self.shard, self.group = model, shard, group
        self.specs: dict[str, Slice] = {}

    def replace(self, name: str, new: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent), child, new)

    def tensor(self, owner: nn.Module, attr: str, name: str, spec: Slice) -> None:
        """Parameter `attr` of `owner` (checkpoint name `name`) becomes this rank's `spec` of it."""
        full = getattr(owner, attr)
        shape = list(full.shape)
        shape[spec.dim] = spec.size
        setattr(owner, attr, nn.Parameter(torch.empty(shape, device="meta", dtype=full.dtype)))
        self.specs[name] = spec

    def column(self, name: str, start: int, stop: int) -> None:
        """Output rows [start, stop) of linear `name`: every tensor is cut along dim 0."""
        mod = self.model.get_submodule(name)
        new = _local_linear(mod, mod.in_features, stop - start, getattr(mod, "bias", None) is not None)
        self.replace(name, new)
        for t in _tensors(new):
            self.specs[f"{name}.{t}"] = Slice(0, start, stop, stop - start)

    def row(self, name: str, reduce: bool = True) -> None:
        """This rank's 1/tp of linear `name`'s inputs: 2-D tensors are cut evenly along dim 1,
        per-output-channel vectors replicated; the bias stays on rank 0 only."""
        mod = self.model.get_submodule(name)
        tp, r = self.shard.tp_size, self.shard.tp_rank
        if isinstance(mod, QuantLinear) and mod.format == "int4" and (mod.in_features // tp) % mod.group_size:
            raise ValueError(  # ParallelConfig.check_model refuses this layout before any process starts
                f"{name}: its {mod.in_features} int4 inputs split {tp} ways are {mod.in_features // tp} columns, "
                f"not whole quantization groups of {mod.group_size}"
            )
        has_bias = getattr(mod, "bias", None) is not None and r == 0
        new = _local_linear(mod, mod.in_features // tp, mod.out_features, has_bias)
        self.replace(name, new)
        for t in _tensors(new):
            full = getattr(mod, t)
            if full.dim() == 2:
                n = full.shape[1] // tp
                self.specs[f"{name}.{t}"] = Slice(1, r * n, (r + 1) * n, n)
        if reduce:
            new.register_forward_hook(_all_reduce_output(self.group))


def shard_model(model: CausalLM, shard: Shard, group=None) -> dict[str, Slice]:
    """Cut meta-device `model` in place for `shard`; returns {tensor name: slice to read}
    (tensors not named are read whole). `group`: the rank's tensor-parallel process group."""
    cfg = model.config
    tp, r = shard.tp_size, shard.tp_rank
    cut = _Cutter(model, shard, group)
    inner = model.model
    mine = shard.layers(cfg.num_hidden_layers)
    for i in range(cfg.num_hidden_layers):
        if i not in mine:
            inner.layers[i] = Placeholder()
    model.mtp = None  # DeepSeek-V3's MTP modules draft in a single process only (--speculative mtp): not read
    vp = -(-cfg.vocab_size // tp)  # per-rank vocabulary rows, padded so that tp divides
    vocab = Slice(0, r * vp, min((r + 1) * vp, cfg.vocab_size), vp)
    if shard.first_stage:
        if tp > 1:
            inner.embed_tokens = VocabParallelEmbedding(
                vp, cfg.hidden_size, r * vp, group, inner.embed_tokens.weight.dtype
            )
            cut.specs["model.embed_tokens.weight"] = vocab
    else:
        inner.embed_tokens = None
    if shard.last_stage:
        if tp > 1:
            with torch.device("meta"):
                model.lm_head = nn.Linear(cfg.hidden_size, vp, bias=False, dtype=model.lm_head.weight.dtype)
            model.lm_head.register_forward_hook(_gather_vocab(group, tp, cfg.vocab_size))
            cut.specs["lm_head.weight"] = vocab
    else:
        inner.norm, model.lm_head = None, None
    if tp == 1:
        return cut.specs
    for i in mine:
        attn = inner.layers[i].self_attn
        (_shard_mla if isinstance(attn, MLAttention) else _shard_attention)(cut, f"model.layers.{i}.self_attn", attn)
        layer, p = inner.layers[i], f"model.layers.{i}.{inner.layers[i].ffn_name}"
        if isinstance(layer.ffn, MoE):
            _shard_moe(cut, p, layer.ffn, shard)
        else:
            assert isinstance(layer.ffn, MLP), type(layer.ffn)
            cols = layer.ffn.gate_proj.out_features // tp
            for proj in ("gate_proj", "up_proj"):
                cut.column(f"{p}.{proj}", r * cols, (r + 1) * cols)
            cut.row(f"{p}.down_proj")
    return cut.specs


def _shard_attention(cut: _Cutter, p: str, attn: nn.Module) -> None:
    """Whole heads per rank: q/k/v column-parallel (GQA by KV head, replicated when there are fewer
    KV heads than ranks), o row-parallel; OLMo 2's full-width q/k norms and the sinks with the heads."""
    tp, r = cut.shard.tp_size, cut.shard.tp_rank
    d, hq, kv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    q_heads = hq // tp
    kv_local, kv_first = (kv // tp, r * kv // tp) if kv >= tp else (1, r // (tp // kv))
    q_rows, kv_rows = (r * q_heads * d, (r + 1) * q_heads * d), (kv_first * d, (kv_first + kv_local) * d)
    cut.column(f"{p}.q_proj", *q_rows)
    for proj in ("k_proj", "v_proj"):
        cut.column(f"{p}.{proj}", *kv_rows)
    cut.row(f"{p}.o_proj")
    if attn.qk_norm == "full":
        for norm, (start, stop) in (("q_norm", q_rows), ("k_norm", kv_rows)):
            local = TensorParallelRMSNorm(getattr(attn, norm), stop - start, (stop - start) * tp, cut.group)
            setattr(attn, norm, local)
            cut.specs[f"{p}.{norm}.weight"] = Slice(0, start, stop, stop - start)
    if attn.sinks is not None:
        cut.tensor(attn, "sinks", f"{p}.sinks", Slice(0, r * q_heads, (r + 1) * q_heads, q_heads))
    attn.num_heads, attn.num_kv_heads = q_heads, kv_local


def _shard_mla(cut: _Cutter, p: str, attn: MLAttention) -> None:
    """Multi-head latent attention: whole heads per rank - the query's up-projection (q_proj, or
    q_b_proj after the q LoRA) and kv_b_proj column-parallel by head, o_proj row-parallel - while the
    compression (q_a_proj, kv_a_proj_with_mqa, their norms) is replicated: every rank computes the
    same latent and keeps the whole latent cache (vLLM's layout; its bytes do not shrink with T)."""
    tp, r = cut.shard.tp_size, cut.shard.tp_rank
    heads = attn.num_heads // tp
    q_width = attn.qk_nope_head_dim + attn.qk_rope_head_dim
    kv_width = attn.qk_nope_head_dim + attn.v_head_dim
    q = "q_proj" if attn.q_lora_rank is None else "q_b_proj"
    cut.column(f"{p}.{q}", r * heads * q_width, (r + 1) * heads * q_width)
    cut.column(f"{p}.kv_b_proj", r * heads * kv_width, (r + 1) * heads * kv_width)
    cut.row(f"{p}.o_proj")
    attn.num_heads = attn.num_kv_heads = heads


@functools.cache
def _expert_parallel(cls: type) -> type:
    """ExpertParallelMoE over a MoE class's own routing and forward (DeepSeekMoE's shared experts)."""
    if cls is MoE:
        return ExpertParallelMoE
    return type(f"ExpertParallel{cls.__name__}", (ExpertParallelMoE, cls), {})


def _shard_shared_experts(cut: _Cutter, name: str, mlp: nn.Module) -> None:
    """DeepSeekMoE's shared experts: one gated MLP that every token runs, split like a dense MLP
    (its down projection unreduced: the MoE block's one all-reduce sums it with the routed experts)."""
    tp, r = cut.shard.tp_size, cut.shard.tp_rank
    width = mlp.gate_proj.out_features
    if width % tp:
        raise ValueError(f"{name}: tensor_parallel_size {tp} does not divide the shared experts' width {width}")
    cols = width // tp
    for proj in ("gate_proj", "up_proj"):
        cut.column(f"{name}.{proj}", r * cols, (r + 1) * cols)
    cut.row(f"{name}.down_proj", reduce=False)


def _shard_moe(cut: _Cutter, name: str, moe: MoE, shard: Shard) -> None:
    tp, r = shard.tp_size, shard.tp_rank
    experts = moe.num_experts
    if getattr(moe, "shared_experts", None) is not None:
        _shard_shared_experts(cut, f"{name}.shared_experts", moe.shared_experts)
    if isinstance(moe.experts, GptOssExperts):
        _shard_stacked_experts(cut, f"{name}.experts", moe, shard)
    elif shard.moe_parallel == "expert":
        per = experts // tp
        moe.__class__ = _expert_parallel(type(moe))
        moe.local_experts = range(r * per, (r + 1) * per)
        for e in range(experts):
            if e not in moe.local_experts:
                moe.experts[e] = Placeholder()
    else:
        gate, up, down = getattr(moe.experts[0], "names", ("w1", "w3", "w2"))
        cols = getattr(moe.experts[0], gate).out_features // tp
        for e in range(experts):
            for w in (gate, up):
                cut.column(f"{name}.experts.{e}.{w}", r * cols, (r + 1) * cols)
            cut.row(f"{name}.experts.{e}.{down}", reduce=False)
    moe.register_forward_hook(_all_reduce_output(cut.group))


def _shard_stacked_experts(cut: _Cutter, name: str, moe: MoE, shard: Shard) -> None:
    """gpt-oss's stacked experts: whole experts per rank (dim 0 of every tensor), or every expert's
    intermediate width cut (gate_up's columns keep their gate/up pairs: 2I/T is even)."""
    tp, r, ex = shard.tp_size, shard.tp_rank, moe.experts
    experts, inter = ex.gate_up_proj.shape[0], ex.down_proj.shape[1]
    if shard.moe_parallel == "expert":
        per = experts // tp
        spec = Slice(0, r * per, (r + 1) * per, per)
        for t in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            cut.tensor(ex, t, f"{name}.{t}", spec)
        moe.__class__, ex.__class__ = ExpertParallelGptOssMoE, LocalGptOssExperts
        moe.local_experts, ex.first, ex.total = range(r * per, (r + 1) * per), r * per, experts
        return
    n = inter // tp
    cut.tensor(ex, "gate_up_proj", f"{name}.gate_up_proj", Slice(2, 2 * r * n, 2 * (r + 1) * n, 2 * n))
    cut.tensor(ex, "gate_up_proj_bias", f"{name}.gate_up_proj_bias", Slice(1, 2 * r * n, 2 * (r + 1) * n, 2 * n))
    cut.tensor(ex, "down_proj", f"{name}.down_proj", Slice(1, r * n, (r + 1) * n, n))
    # Row-parallel: the output bias is added once, by rank 0; the others read an empty slice, zero-padded.
    bias = Slice(0, 0, 0, experts) if r else Slice(0, 0, experts, experts)
    cut.tensor(ex, "down_proj_bias", f"{name}.down_proj_bias", bias)
