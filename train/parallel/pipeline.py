"""Pipeline parallelism: the model cut into stages by layer, run by torch.distributed.pipelining.

Stages are `ModelChunk`s: views of the one CausalLM that keep its parameter names, so a state
dict (and a DCP checkpoint) reads the same at every layout. Layers are split into contiguous
groups that balance compute: every layer costs 1, the LM head on the last stage costs its matmul
size in layer-equivalents, the embedding lookup (no matmul) nothing. With interleaving, rank r
holds stages r, r + pp, r + 2 pp, ... (Megatron's virtual pipeline).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.distributed as dist
from baton.common.config import ModelConfig
from baton.common.model import AttentionBackend, CausalLM, DenseCausalAttention, run_layers, soft_cap
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule


class ModelChunk(nn.Module):
    """Embedding (first chunk), decoder layers `layers`, final norm + LM head (last chunk, with the
    MTP modules where the model has them): the model's own modules, run as its forward runs them
    (common.model.run_layers).

    forward: token ids (first) or hidden states -> hidden states, or logits (last). RoPE positions
    are set from outside (`positions`, [S_local]) since later stages cannot see the tokens and
    context parallelism gives each rank non-contiguous positions."""

    def __init__(self, model: CausalLM, layers: range, first: bool, last: bool, device: torch.device | None = None):
        super().__init__()
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = model.model.embed_tokens
        self.embed_scale = model.model.embed_scale
        self.logit_cap = model.config.final_logit_softcapping
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        # The final norm under the model's own name (Bamba's is final_layernorm), so names match.
        self.norm_name = "final_layernorm" if hasattr(model.model, "final_layernorm") else "norm"
        if last:
            setattr(self.model, self.norm_name, model.model.final_norm)
            self.lm_head = model.lm_head
            if model.mtp is not None:  # DeepSeek-V3's MTP modules (trained by baton.train.mtp's hook on the norm)
                self.mtp = model.mtp
        self.has_embedding, self.has_head = first, last
        self.tied = model.config.tie_word_embeddings
        # A float32 attribute as in DecoderModel (not a buffer: .to() leaves it), so placed here on the rank's device.
        self.inv_freq = model.model.inv_freq if device is None else model.model.inv_freq.to(device)
        self.attn: AttentionBackend = DenseCausalAttention()
        self.positions: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_embedding:
            x = self.model.embed_tokens(x)
            if self.embed_scale is not None:  # as DecoderModel.embed
                x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        positions = self.positions.to(x.device).expand(x.shape[0], -1)
        x = run_layers(self.model.layers.values(), x, positions, self.inv_freq, self.attn)
        if self.has_head:
            x = soft_cap(self.lm_head(getattr(self.model, self.norm_name)(x)), self.logit_cap)
        return x


def stage_costs(cfg: ModelConfig) -> tuple[float, float]:
    """(cost of one decoder layer, cost of the LM head), proportional to matmul FLOPs per token."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    experts = cfg.num_experts_per_tok if cfg.num_local_experts else 1  # MoE: top-k experts per token
    width = cfg.expert_intermediate_size if cfg.num_local_experts else cfg.intermediate_size  # (Qwen3-MoE's own)
    layer = h * (2 * q + 2 * kv) + 3 * h * width * experts
    return 1.0, h * cfg.vocab_size / layer


def split_layers(num_layers: int, num_stages: int, head_cost: float) -> list[range]:
    """Contiguous layer ranges, >= 1 layer each, minimising the most expensive stage (the last
    stage also pays `head_cost`); ties go to the most even split."""

    @cache
    def best(start: int, stages: int) -> tuple[float, tuple[int, ...]]:
        if stages == 1:
            return num_layers - start + head_cost, (num_layers,)
        options = []
        for end in range(start + 1, num_layers - stages + 2):
            rest, cuts = best(end, stages - 1)
            options.append((max(end - start, rest), cuts, end))
        cost, cuts, end = min(options, key=lambda o: (o[0], abs(o[2] - start - num_layers / num_stages)))
        return cost, (end, *cuts)

    bounds = (0, *best(0, num_stages)[1])
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def local_stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    return [pp_rank + v * pp for v in range(stages_per_rank)]


def build_chunks(
    model: CausalLM, pp_rank: int, pp: int, stages_per_rank: int, device: torch.device | None = None
) -> tuple[list[int], list[ModelChunk]]:
    """This rank's stage ids and chunks (the whole model as one chunk when pp == 1); `device`: where
    the chunks' RoPE frequencies live (their parameters are wherever the model's are)."""
    num_stages = pp * stages_per_rank
    ranges = split_layers(model.config.num_hidden_layers, num_stages, stage_costs(model.config)[1])
    ids = local_stage_ids(pp_rank, pp, stages_per_rank)
    return ids, [ModelChunk(model, ranges[s], s == 0, s == num_stages - 1, device) for s in ids]


def build_schedule(
    kind: str,
    chunks: list[nn.Module],
    stage_ids: list[int],
    num_stages: int,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device,
) -> _PipelineSchedule:
    """`loss_fn` returns a micro-batch's mean loss; gradients are scaled by 1/microbatches, so
    they equal those of the mean loss over the whole batch."""
    stages = [PipelineStage(c, s, num_stages, device, group=group) for c, s in zip(chunks, stage_ids)]
    if kind == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
    return cls(stages[0], microbatches, loss_fn=loss_fn)
