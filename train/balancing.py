"""DeepSeek-V3's auxiliary-loss-free load balancing (arXiv 2412.19437 sec. 2.1.2; Wang et al. 2024):
after every optimizer step each DeepSeekMoE layer's score-correction bias moves by
`moe.bias_update_rate` against the sign of its experts' load error, outside the gradient
(DeepSeekMoE.update_bias: b_i += rate * sign(mean_j load_j - load_i)).

The load is the step's, summed over every micro-batch and every rank: one all-reduce of a
[MoE layers, experts] tensor over the whole process group (each rank fills the layers it ran), as
Megatron sums tokens_per_expert over its tensor x data x context-parallel group. So every rank moves
its copy of the bias alike and the copies never drift apart, whatever the layout: data-parallel
ranks (and expert-parallel ones, which route their own tokens) add their tokens up; tensor-parallel
ranks route the same tokens and count them tp times over, a common factor the sign ignores; a
pipeline stage's rows stay zero on the ranks of the other stages. A step that was skipped (a
non-finite loss) moves nothing.

The bias is a persistent buffer (baton.common.deepseek_moe): the checkpoints and the handoff carry it
where a backend saves buffers. The logs get `moe_max_violation`, the mean over layers of
max_i load_i / mean_j load_j - 1 (Wang et al.'s MaxVio; 0 when balanced), and the sequence-wise
loss's value (baton.train.moe.router_metrics).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from baton.common.deepseek_moe import DeepSeekMoE
from baton.train.moe import coefficient
from torch import nn


class ExpertBalancer:
    """The bias updates of one model's DeepSeekMoE layers (every rank builds one; `step` is collective)."""

    def __init__(self, model: nn.Module, rate: float):
        # Every rank holds the whole model's structure (a pipeline rank runs some layers), so the
        # order of model.modules() indexes the layers alike everywhere.
        self.layers = [m for m in model.modules() if isinstance(m, DeepSeekMoE)]
        self.rate = rate
        self.violation: torch.Tensor | None = None  # sum of per-step MaxVio since the last metrics()
        self.steps = 0

    def step(self, applied: bool) -> None:
        """Collective, after the optimizer step: sum the step's loads over all ranks and move every
        held bias (`applied` False: the update was skipped; the loads are dropped, nothing moves)."""
        device = next((m.gate.weight.device for m in self.layers if not m.gate.weight.is_meta), torch.device("cpu"))
        loads = torch.zeros(len(self.layers), self.layers[0].num_experts, dtype=torch.float64, device=device)
        for row, m in zip(loads, self.layers):
            if m.expert_load is not None:
                row.copy_(m.expert_load)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loads)  # (float64: exact counts up to 2**53 token-slots)
        for row, m in zip(loads, self.layers):
            if applied and not m.gate.e_score_correction_bias.is_meta:
                m.update_bias(self.rate, row)
            else:
                m.expert_load = None
        ran = loads.sum(dim=1) > 0
        if applied and ran.any():
            vio = (loads[ran].max(dim=1).values / loads[ran].mean(dim=1) - 1).mean()
            self.violation = vio if self.violation is None else self.violation + vio
            self.steps += 1

    def metrics(self) -> dict[str, float]:
        """Mean MaxVio over the steps since the last call (every rank reports the same)."""
        if not self.steps:
            return {}
        out = {"moe_max_violation": self.violation.item() / self.steps}
        self.violation, self.steps = None, 0
        return out

    def biases(self) -> list[torch.Tensor]:
        """Every layer's correction bias (copies), in the model's order."""
        return [m.gate.e_score_correction_bias.detach().clone() for m in self.layers]


def attach_balancing(model: nn.Module, rate: float | None, seq_coef: float | None) -> ExpertBalancer | None:
    """DeepSeek-V3's balancing for `model` per the recipe's moe section (None: DeepSeek-V3's values):
    the sequence-wise loss's weight on the hooks baton.train.moe.attach_router_losses gave the
    layers, and the balancer the trainer steps after every update (None: no DeepSeekMoE layer)."""
    layers = [m for m in model.modules() if isinstance(m, DeepSeekMoE)]
    if not layers:
        return None
    coef = coefficient(seq_coef, "seq_aux_loss_coef", True)
    hooks = {m.seq_loss for m in layers if m.seq_loss is not None}
    if coef and not hooks:
        raise RuntimeError("the DeepSeekMoE layers have no sequence-loss hook: attach_router_losses first")
    for hook in hooks:
        hook.coef = coef
    if not coef:
        for m in layers:
            m.seq_loss = None  # (the layers then skip computing it)
    return ExpertBalancer(model, coefficient(rate, "bias_update_rate", True))
