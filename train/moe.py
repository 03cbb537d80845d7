"""MoE router losses for training: Switch/Mixtral load balancing and the ST-MoE router z-loss for
softmax routers, DeepSeek-V3's sequence-wise balance loss for its sigmoid router.

Per MoE layer, on the token-slots of one micro-batch (T tokens, E experts, top-k):
  load balancing  E * sum_i f_i * P_i,  f_i = tokens routed to expert i / T (the f_i sum to k),
                  P_i = mean router probability of expert i   (Switch eq. 4; HF Mixtral's
                  load_balancing_loss_func on that one layer's logits: k when perfectly balanced)
  router z-loss   mean over tokens of logsumexp(router logits)^2   (ST-MoE eq. 5)
Both are averaged over the MoE layers (so a coefficient means the same at any depth) and weighted
by the recipe's `moe.aux_loss_coef` / `moe.z_loss_coef`. HF's whole-model call pools every
layer's statistics before multiplying them; per layer is Switch's and Megatron's definition.

The losses reach the gradients through Megatron's MoEAuxLossAutoScaler trick: an autograd
function returns the layer's output unchanged and, in backward, injects d(coef x loss)/d(router)
scaled like the main loss (1 / micro-batches per step). No backend's loss code changes, and it
works through pipeline stages (the loss lives where its layer does), FSDP2, DDP and ZeRO. Every
micro-batch's loss is local to its rank: data-parallel averaging then gives exactly the gradient
of the mean over all micro-batches, as one process accumulating them would.

The values are recorded on the modules (detached) and read by `router_metrics` for the logs.

Every MoE family Baton builds (baton.common.moe) routes top-k of its router logits, so the same two
losses apply to each: Mixtral's, Qwen3-MoE's and gpt-oss's load_balancing_loss_func in transformers
is this one (softmax over all logits, top-k of it; gpt-oss's logits include the router bias, and
its routing weights, a softmax over the k chosen logits only, do not enter the loss), and HF's
router_aux_loss_coef is `moe.aux_loss_coef` (tests/common/test_moe_families.py checks the values).

DeepSeek-V3 (baton.common.deepseek_moe) routes by sigmoid affinities with a bias-corrected choice: a
softmax over its logits describes neither, so its layers refuse both losses. They balance with the
correction bias (baton.train.balancing) and, weighted by `moe.seq_aux_loss_coef`, DeepSeek-V3's
sequence-wise loss sum_i f_i P_i (eq. 17-20; the layer computes it), injected the same way and
averaged over the MoE layers like the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from baton.common.deepseek_moe import DeepSeekMoE
from baton.common.moe import MoE
from torch import nn


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on `out`; backward gives `loss` the gradient `scale` (d total / d loss)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def load_balancing_loss(logits: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_i f_i P_i for one layer (logits [T, E], chosen [T, k]), in float32."""
    probs = F.softmax(logits.float(), dim=-1)
    counts = torch.bincount(chosen.flatten(), minlength=num_experts).to(probs.dtype)
    return num_experts * torch.sum(counts / logits.shape[0] * probs.mean(dim=0))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(logits_t)^2: keeps router logits small (ST-MoE), in float32."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


# What a coefficient the recipe leaves unset (None) means, by routing: softmax routers (Mixtral, Qwen3-MoE,
# gpt-oss) train with Switch's loss and the z-loss; DeepSeek-V3's sigmoid router with its correction bias
# (baton.train.balancing) and its sequence-wise loss, at the paper's values.
SOFTMAX_DEFAULTS = {"aux_loss_coef": 0.01, "z_loss_coef": 0.001, "bias_update_rate": 0.0, "seq_aux_loss_coef": 0.0}
DEEPSEEK_DEFAULTS = {"aux_loss_coef": 0.0, "z_loss_coef": 0.0, "bias_update_rate": 0.001, "seq_aux_loss_coef": 0.0001}


def coefficient(value: float | None, name: str, deepseek: bool) -> float:
    """A moe-section value, None read as the routing's default."""
    return float((DEEPSEEK_DEFAULTS if deepseek else SOFTMAX_DEFAULTS)[name] if value is None else value)


class RouterLoss:
    """MoE.router_loss for one model: adds coef x loss / layers to the backward, records values."""

    def __init__(self, aux_coef: float, z_coef: float, num_layers: int, micro_batches: int = 1):
        self.aux_coef, self.z_coef, self.num_layers = aux_coef, z_coef, num_layers
        self.micro_batches = micro_batches  # the main loss is divided by it before backward

    def __call__(self, moe: MoE, out: torch.Tensor, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # eval and serving: no gradients, nothing logged
            return out
        aux = load_balancing_loss(logits, chosen, len(moe.experts))
        z = router_z_loss(logits)
        zero = (torch.bincount(chosen.flatten(), minlength=len(moe.experts)) == 0).sum()
        _record(moe, aux=aux.detach(), z=z.detach(), zero_experts=zero)
        scale = 1.0 / (self.num_layers * self.micro_batches)
        total = self.aux_coef * aux + self.z_coef * z
        if total.requires_grad and (self.aux_coef or self.z_coef):
            out = AuxLossAutoScaler.apply(out, total, scale)
        return out


class SequenceLoss(RouterLoss):
    """DeepSeekMoE.seq_loss for one model: DeepSeek-V3's sequence-wise balance loss (computed by the
    layer, baton.common.deepseek_moe), coef x loss / layers into the backward, values recorded."""

    def __init__(self, coef: float, num_layers: int, micro_batches: int = 1):
        super().__init__(0.0, 0.0, num_layers, micro_batches)
        self.coef = coef

    def __call__(self, moe: MoE, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        _record(moe, seq_aux=loss.detach())
        if loss.requires_grad and self.coef:
            out = AuxLossAutoScaler.apply(out, self.coef * loss, 1.0 / (self.num_layers * self.micro_batches))
        return out


def _record(moe: MoE, **values: torch.Tensor) -> None:
    """Running sums since the last router_metrics call (kept on the device: no host sync here)."""
    stats = moe.__dict__.setdefault("router_stats", {"n": 0})
    if stats["n"] == 0:
        stats.update(values, n=1)
    else:
        stats.update({k: stats[k] + v for k, v in values.items()}, n=stats["n"] + 1)


def attach_router_losses(
    model: nn.Module,
    aux_coef: float | None,
    z_coef: float | None,
    micro_batches: int,
    seq_coef: float | None = None,
) -> int:
    """Give every MoE layer of `model` its router losses (None: the routing's default, SOFTMAX_DEFAULTS
    or DEEPSEEK_DEFAULTS); returns how many layers there are. DeepSeekMoE layers take the
    sequence-wise loss (`seq_coef`) and refuse the softmax losses (see baton.common.deepseek_moe)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    softmax = RouterLoss(
        coefficient(aux_coef, "aux_loss_coef", False),
        coefficient(z_coef, "z_loss_coef", False),
        len(layers),
        micro_batches,
    )
    sequence = SequenceLoss(coefficient(seq_coef, "seq_aux_loss_coef", True), len(layers), micro_batches)
    for m in layers:
        if not isinstance(m, DeepSeekMoE):
            m.router_loss = softmax
        elif aux_coef or z_coef:
            raise ValueError(
                f"aux_coef {aux_coef} / z_coef {z_coef} on a DeepSeekMoE layer: Switch's loss and the z-loss are "
                "a softmax over the router logits, which DeepSeek-V3's sigmoid, bias-corrected routing is not"
            )
        else:  # (no hook at 0: the layer then skips computing the loss)
            m.seq_loss = sequence if sequence.coef else None
    return len(layers)


def set_loss_divisor(module: nn.Module, micro_batches: int) -> None:
    """What the backend divides each micro-batch's loss by before its backward: a pipeline schedule
    divides by 1 (it sums the micro-batches' gradients and divides them at the end, where the
    router losses' gradients are divided too)."""
    for m in module.modules():
        if isinstance(m, MoE):
            for hook in (m.router_loss, getattr(m, "seq_loss", None)):
                if isinstance(hook, RouterLoss):
                    hook.micro_batches = micro_batches


def router_metrics(model: nn.Module) -> dict[str, float]:
    """Mean router losses since the last call over this rank's MoE layers (under a pipeline: the
    layers of its stages) - Switch's load balancing and the z-loss, or DeepSeek-V3's sequence-wise
    loss - and how many (layer, micro-batch) pairs left an expert without tokens (softmax routers;
    DeepSeek's loads are baton.train.balancing's); resets the sums. Empty for a dense model."""
    sums: dict[str, float] = {}
    calls = 0
    for m in model.modules():
        stats = m.__dict__.get("router_stats") if isinstance(m, MoE) else None
        if not stats or stats["n"] == 0:
            continue
        for key, value in stats.items():
            if key != "n":
                sums[key] = sums.get(key, 0.0) + value.item()
        calls += stats["n"]
        stats["n"] = 0
    if calls == 0:
        return {}
    out = {f"moe_{k}_loss": sums[k] / calls for k in ("aux", "z", "seq_aux") if k in sums}
    if "zero_experts" in sums:
        out["moe_zero_token_experts"] = int(sums["zero_experts"])
    return out
