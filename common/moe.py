"""Mixture-of-experts feed-forward blocks: routing and the experts' grouped compute.

The decoder layer (common/model.py) builds one of these where cfg.is_moe_layer(i), under the
family's checkpoint name (cfg.moe_attribute). Expert parallelism (serve/parallel, train/parallel)
narrows `held_experts` and overrides `combine` from outside.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from baton.common.config import ModelConfig
from baton.kernels import swiglu
from torch import nn


class Expert(nn.Module):
    """One Mixtral expert; w1/w3/w2 are gate/up/down (the names Mixtral checkpoints use)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class MoE(nn.Module):
    """Top-k routed experts: softmax over all router logits, keep top-k, renormalise.

    Experts run grouped: token-slots sorted by expert (one argsort, one host sync for the group
    sizes), one matmul chain per expert batch. `run_experts` is the grouped compute that the
    serving side (ExpertParallelMoE) and training's expert parallelism (all-to-all dispatch,
    baton.train.parallel.expert_parallel) share; they override `held_experts` / `combine`.

    While gradients are recorded every held expert runs, even on zero token-slots: the empty
    matmuls give its weights zero gradients, so every parameter has a gradient on every rank and
    DDP's reducer and FSDP2's reduce-scatters see the same parameters everywhere (skipping it
    crashed both as soon as a rank routed no token to some expert). Without gradients (serving,
    eval) empty experts are skipped: they would only cost kernel launches.
    """

    # Set from outside (baton.train.moe) to add auxiliary router losses: called with (module,
    # output, router logits, chosen experts), returns the output (which may carry their gradients).
    router_loss = None
    # True where the experts are sharded units that every rank must run (FSDP2-wrapped experts).
    always_run_experts = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.intermediate_size) for _ in range(cfg.num_local_experts)
        )

    def held_experts(self) -> range:
        """The experts this module runs: all of them (expert parallelism, applied from outside,
        narrows it to a rank's share and sums the shares)."""
        return range(len(self.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        probs = F.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.combine(x, weights, chosen)
        if self.router_loss is not None:
            out = self.router_loss(self, out, logits, chosen)
        return out.reshape(shape)

    def combine(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """sum_k weight_k * expert_k(x) per token, over the held experts' token-slots."""
        out = torch.zeros_like(x)
        # Token-slots grouped by expert (stable: in token order within one, as torch.where gave them),
        # and one host sync for the group sizes instead of one per expert.
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        held = self.held_experts()
        first, last = sum(counts[: held.start]), sum(counts[: held.stop])  # held experts' slots
        slots = order[first:last]
        token_idx = slots // self.top_k
        y = self.run_experts(x[token_idx], counts[held.start : held.stop], held)
        # One index_add in expert order: per token the same additions, in the same order, as
        # adding expert by expert (HF's loop), so logits stay bit-identical on CPU.
        out.index_add_(0, token_idx, (y * weights.flatten()[slots, None]).to(x.dtype))
        return out

    def run_experts(self, xs: torch.Tensor, counts: list[int], experts: Iterable[int]) -> torch.Tensor:
        """Grouped expert compute: `xs` holds counts[i] rows for experts[i], one after another;
        returns each row through its expert, in the same order (one matmul chain per expert)."""
        run_empty = self.always_run_experts or torch.is_grad_enabled()
        ys = [
            self.experts[e](part) if part.shape[0] or run_empty else part for e, part in zip(experts, xs.split(counts))
        ]
        return torch.cat(ys) if ys else xs


def build_moe(cfg: ModelConfig) -> nn.Module:
    """The family's MoE block for one layer (the decoder layer names it cfg.moe_attribute)."""
    return MoE(cfg)


def build_moe(cfg: ModelConfig) -> nn.Module:
    """The routed-experts block of cfg's family (forward: [..., H] -> [..., H])."""
    return MoE(cfg)
