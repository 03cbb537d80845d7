"""DeepSeek-V3's multi-token prediction (MTP) trained beside the language model: the recipe's `mtp:`.

The model's MTP modules (baton.common.mtp; CausalLM.mtp) run on the main model's final hidden
states, module k predicting the token k + 1 past the main model's target. The objective is
DeepSeek-V3's (arXiv 2412.19437 eq. 25) with Megatron's normalisation:

    L = L_main + lambda / D * sum_k L_k,   L_k = mean over the positions i of the micro-batch's
                                                  block of CE(module k's logits at i, t_{i+k+1})

A block of S + 1 tokens gives the main model S targets and module k S - k (the targets past the
block do not exist), as Megatron's rolled labels and loss mask do. CausalLM.mtp_logits is the
forward (the modules over whole sequences with dense causal attention, the shared LM head).

How it reaches the gradients without any backend changing its loss: a forward hook on the final
norm takes the main hidden states, runs the modules and returns the hidden states through
baton.train.moe's AuxLossAutoScaler, which hands lambda x L_MTP the gradient scale of the main
loss in the backward (Megatron's MTPLossAutoScaler). The hook needs each micro-batch's whole block
(its last token is only a label): the trainer `feed`s the step's micro-batches before the backend
runs them, and the hook checks every one against the ids the embedding saw. So it works wherever
the whole model runs in one module per rank - plain PyTorch, DDP, ZeRO 0-3, torch3d's FSDP2 and
expert parallelism - and is refused (validate) under pipeline, tensor and context parallelism,
which split the hidden states, the head or the sequence it needs, and beside LayerSkip's exits.
`StepResult.loss` stays the main model's loss; the MTP loss is logged as mtp_loss.

The handoff carries the trained modules as `model.layers.{num_hidden_layers + k}.*`, where
transformers ignores them and Baton's loader (and `baton serve --speculative mtp`) reads them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from baton.common.checkpoint import reconcile_mtp, tensor_names
from baton.common.config import ConfigError, ModelConfig
from baton.common.model import CausalLM
from baton.train.moe import AuxLossAutoScaler

log = logging.getLogger(__name__)

DEFAULT_LOSS_WEIGHT = 0.3  # DeepSeek-V3's lambda for its first 10T tokens (0.1 for the last 4.8T)


@dataclass
class MTPConfig:
    """The recipe's `mtp:` section. Unset: a model with MTP modules (a DeepSeek-V3 checkpoint that
    has them, or model.num_nextn_predict_layers) trains them at DeepSeek-V3's lambda."""

    num_layers: int | None = None  # D modules; None: the model's (num_nextn_predict_layers); 0: none
    loss_weight: float | None = None  # lambda; None: 0.3

    @property
    def weight(self) -> float:
        return DEFAULT_LOSS_WEIGHT if self.loss_weight is None else float(self.loss_weight)

    def check(self, need, model: ModelConfig) -> None:
        """The section's own values against the model (with_mtp has applied it: `model` is the
        run's); the backend and layout checks are baton.train.validate's."""
        n, w = self.num_layers, self.loss_weight
        need(
            n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 0),
            f"mtp.num_layers must be an integer >= 0 or null, got {n!r}",
        )
        need(
            w is None or (isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0),
            f"mtp.loss_weight must be a number >= 0, got {w!r}",
        )
        need(
            w is None or model.num_nextn_predict_layers > 0,
            "mtp.loss_weight is set but the model has no MTP modules: set mtp.num_layers (deepseek_v3), or "
            "init_from a checkpoint that has them",
        )


def with_mtp(cfg: ModelConfig, mtp: MTPConfig, init_from: str | None, section_layers: Any = None) -> ModelConfig:
    """`cfg` with the MTP modules this run trains: init_from's where the checkpoint holds their
    weights (a DeepSeek-V3 config says 1 whether or not they are there), then `mtp.num_layers`
    (0 drops them; fewer than the checkpoint's keeps the first). `section_layers`: the model
    section's num_nextn_predict_layers, which must not contradict it."""
    if init_from is not None and cfg.num_nextn_predict_layers > 0:
        cfg = reconcile_mtp(cfg, tensor_names(init_from) or ())
    n = mtp.num_layers
    if n is None or not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return cfg  # (a bad value is MTPConfig.check's to name)
    if n > 0 and cfg.model_type != "deepseek_v3":
        raise ConfigError(
            f"mtp.num_layers {n}: multi-token prediction modules are DeepSeek-V3's (model_type deepseek_v3), "
            f"not {cfg.model_type!r}'s"
        )
    if init_from is not None and n > cfg.num_nextn_predict_layers:
        have = cfg.num_nextn_predict_layers
        raise ConfigError(
            f"mtp.num_layers {n}: init_from {init_from} holds {have} MTP module(s) to start from; "
            f"set mtp.num_layers to at most {have} (0 trains none)"
        )
    if section_layers is not None and section_layers != n:
        raise ConfigError(
            f"mtp.num_layers {n} and model.num_nextn_predict_layers {section_layers} disagree: drop one "
            "(mtp.num_layers sets the model's)"
        )
    return dataclasses.replace(cfg, num_nextn_predict_layers=n)


def mtp_losses(model: CausalLM, hidden: torch.Tensor, block: torch.Tensor) -> list[torch.Tensor]:
    """L_k for k = 1..D (float32 scalars): `block` [B, S + 1] tokens, `hidden` [B, S, H] the main
    model's final hidden states on block[:, :-1]; module k's row i predicts block[:, i + k + 1]."""
    logits = model.mtp_logits(block[:, :-1], hidden=hidden)
    return [F.cross_entropy(lg.flatten(0, 1).float(), block[:, k + 1 :].flatten()) for k, lg in enumerate(logits, 1)]


class MTPLoss:
    """The MTP objective attached to a model's final norm (see the module docstring)."""

    def __init__(self, model: CausalLM, weight: float, micro_batches: int):
        if model.mtp is None:
            raise ValueError("the model has no MTP modules to train")
        self.model, self.weight, self.micro_batches = model, weight, micro_batches
        self.pending: deque[torch.Tensor] = deque()
        self.ids: torch.Tensor | None = None  # what the embedding last saw outside the MTP modules
        self.inside = False
        self.sums: torch.Tensor | None = None  # per-depth loss sums since the last metrics() (on the device)
        self.count = 0
        self.handles = [
            model.model.embed_tokens.register_forward_pre_hook(self._saw_ids),
            model.model.final_norm.register_forward_hook(self._after_norm),
        ]

    def feed(self, micro_batches: list[torch.Tensor]) -> None:
        """The step's micro-batches ([B, S + 1] blocks), in the order the backend runs them."""
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} micro-batch(es) of the last step never reached the model")
        self.pending.extend(micro_batches)

    def _saw_ids(self, module, args) -> None:
        if torch.is_grad_enabled() and not self.inside:
            self.ids = args[0]

    def _after_norm(self, module, args, hidden: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: the main model's loss only
            return hidden
        if not self.pending:
            raise RuntimeError("MTP: a training forward without its micro-batch (MTPLoss.feed it the step's first)")
        block = self.pending.popleft().to(hidden.device)
        if self.ids is None or not torch.equal(self.ids, block[:, :-1]):
            raise RuntimeError("MTP: the model ran other tokens than the micro-batch fed for it (out of order?)")
        self.inside = True
        try:
            losses = torch.stack(mtp_losses(self.model, hidden, block))
        finally:
            self.inside = False
        detached = losses.detach()
        self.sums = detached if self.sums is None else self.sums + detached
        self.count += 1
        # Zero weight still runs the modules: every rank's MTP parameters then have a (zero) gradient,
        # as DDP's reducer and FSDP2's reduce-scatters need.
        return AuxLossAutoScaler.apply(hidden, losses.mean(), self.weight / self.micro_batches)

    def metrics(self) -> dict[str, float]:
        """Collective (every rank runs the whole model on its own micro-batches): the mean MTP loss
        over the modules and over every rank's micro-batches since the last call, and each module's
        when D > 1."""
        if self.sums is None:
            return {}
        totals = torch.cat([self.sums, torch.tensor([float(self.count)], device=self.sums.device)])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        per = (totals[:-1] / totals[-1]).tolist()
        self.sums, self.count = None, 0
        out = {"mtp_loss": sum(per) / len(per)}
        if len(per) > 1:
            out.update({f"mtp_loss_{k}": v for k, v in enumerate(per, 1)})
        return out

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
