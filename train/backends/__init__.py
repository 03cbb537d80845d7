"""Training backends: how a step is executed across processes, and how its state is saved.

`ddp` is plain PyTorch (one process, or DistributedDataParallel under torchrun); `deepspeed` is
ZeRO stage 0-3 with CPU/NVMe offload; `torch3d` is dp x pp x cp x tp parallelism (baton.train.parallel);
`megatron` is megatron-core's. torch3d and megatron take their layout from the recipe's `parallel`
section. The training loop only sees the `Backend` protocol (baton.train.backends.base, with what
the backends share; its names are importable from here too); `build_backend` picks one.
"""

from __future__ import annotations

from typing import Any

from baton.common.model import AttentionBackend, CausalLM
from baton.train.backends.base import (
    COMPUTE_DTYPES,
    Backend,
    Layout,
    StepResult,
    autocast,
    lm_loss,
    loss_scaler,
    param_groups,
    step_loss,
)
from baton.train.config import TrainConfig
from baton.train.distributed import Dist
from baton.train.moe import attach_router_losses

__all__ = [
    "COMPUTE_DTYPES",
    "Backend",
    "Layout",
    "StepResult",
    "autocast",
    "build_backend",
    "lm_loss",
    "loss_scaler",
    "param_groups",
    "step_loss",
]


def build_backend(
    cfg: TrainConfig, model: CausalLM, attn: AttentionBackend, dist: Dist, pretrained: Any = None
) -> Backend:
    """`pretrained` (init_from): the PretrainedWeights `model` starts from (baton.train.pretrained);
    torch3d fills its meta-built shards from them, DeepSpeed its float32 master weights."""
    # MoE models: the router losses join the backward of every backend, scaled like its loss.
    attach_router_losses(
        model, cfg.moe.aux_loss_coef, cfg.moe.z_loss_coef, cfg.accum_steps(cfg.data_parallel_size(dist.world_size))
    )
    if cfg.backend == "deepspeed":
        from baton.train.backends.deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(cfg, model, attn, dist, pretrained)
    if cfg.backend == "megatron":
        from baton.train.backends.megatron import MegatronBackend

        return MegatronBackend(cfg, model, attn, dist)
    if cfg.backend == "torch3d":
        from baton.train.backends.torch3d import Torch3DBackend

        return Torch3DBackend(cfg, model, attn, dist, pretrained=pretrained)
    from baton.train.backends.ddp import DDPBackend

    return DDPBackend(cfg, model, attn, dist)
