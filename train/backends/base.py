"""What every training backend is and shares: the `Backend` protocol the training loop drives, a
step's `StepResult`, the checkpoint `Layout`, and the pieces backends build their steps from
(mixed precision, AdamW parameter groups, the loss). baton.train.backends picks the backend.

Mixed precision (the recipe's `precision`) is each backend's own: torch.autocast over float32
parameters for plain PyTorch / DDP (and torch3d without FSDP, as torchtitan does), FSDP2's
MixedPrecisionPolicy, DeepSpeed's bf16/fp16 sections, megatron's Float16Module. In every backend
the optimizer steps float32 master weights and gradients are reduced in float32; fp16 adds a
dynamic loss scaler.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from baton.common.model import CausalLM
from baton.train.config import TrainConfig
from baton.train.distributed import Dist


@dataclass
class StepResult:
    """What one optimizer step did: all the training loop logs and counts."""

    loss: float  # mean over the step's micro-batches on every rank
    grad_norm: float | None  # before clipping (None: the backend did not report one)
    applied: bool  # False: the update was skipped (non-finite loss or gradients)
    loss_scale: float | None = None  # fp16: the dynamic loss scale this step's backward ran at
    overflow: bool = False  # fp16: skipped because the scaled gradients overflowed; the scale was halved


@dataclass(frozen=True)
class Layout:
    """What a checkpoint's files depend on; a different layout is resumed through the universal form."""

    backend: str
    world_size: int
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_param: str = "none"
    precision: str = "fp32"  # DeepSpeed's files hold the module in the compute dtype


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward's mixed precision over float32 parameters: matmuls and attention in the compute
    dtype, norms, softmax and the loss in float32 (torch.autocast's op lists); nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=COMPUTE_DTYPES[precision])


def loss_scaler(device: torch.device, cfg: TrainConfig) -> torch.amp.GradScaler | None:
    """fp16's dynamic loss scaler (None otherwise): starts at 2**initial_power, halves on every
    step whose gradients overflow (the step is skipped), doubles after `window` clean steps."""
    if cfg.precision != "fp16":
        return None
    ls = cfg.loss_scale
    return torch.amp.GradScaler(device.type, init_scale=2.0**ls.initial_power, growth_interval=ls.window)


class Backend(Protocol):
    module: CausalLM  # the bare model (parameters may be ZeRO-3 partitions)
    layout: Layout

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        """Collective: one optimizer step at `lr` over this rank's micro-batches ([B, S+1] token
        blocks, all of the step's at once: a pipeline schedule needs them together). Gradients are
        those of the mean loss over every rank's micro-batches; a step whose loss or gradients are
        not finite leaves the weights and the optimizer state as they were."""

    def eval_loss(self, batch: torch.Tensor) -> float: ...

    def save(self, directory: Path) -> None:
        """Collective: every rank writes its part into `directory` (shared by all ranks)."""

    def load(self, directory: Path, saved: Layout) -> None:
        """Collective: restore model and optimizer state from a checkpoint of any layout."""

    def memory(self) -> dict[str, Any]: ...


def param_groups(model: CausalLM, weight_decay: float) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """AdamW groups, and their parameter names: weight decay on matrices only (not norms,
    biases), as nanoGPT and Megatron. ZeRO flattens each group into one buffer."""
    named = [(n, len(getattr(p, "ds_shape", p.shape)), p) for n, p in model.named_parameters() if p.requires_grad]
    # (a ZeRO-3 parameter made under zero.Init is an empty placeholder: its shape is ds_shape)
    split = [[(n, p) for n, d, p in named if d >= 2], [(n, p) for n, d, p in named if d < 2]]
    groups = [{"params": [p for _, p in g], "weight_decay": wd} for g, wd in zip(split, (weight_decay, 0.0))]
    return groups, [[n for n, _ in g] for g in split]


def lm_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in float32."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def step_loss(dist: Dist, loss_sum: torch.Tensor, micro_batches: int) -> float:
    """The step's loss from this rank's sum of micro-batch losses: the mean over every rank's
    micro-batches, the same number on all ranks (so all skip a non-finite step together)."""
    return dist.all_reduce_sum(loss_sum.reshape(1)).item() / (micro_batches * dist.world_size)
