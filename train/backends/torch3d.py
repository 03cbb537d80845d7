"""3D parallelism (dp x pp x cp x tp) with torch.distributed's own tools, as a training backend.

The layout comes from the recipe's `parallel` section (baton.train.parallel.layout). The model is
parallelized from outside (baton.train.parallel.parallelize); checkpoints are DCP, written shard by
shard under whole-parameter names, so a run resumes at any other layout, and the plain-PyTorch
backend or `baton export` read them as whole tensors. A step's micro-batches arrive together
(train_step), as the pipeline schedule needs them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from baton.common.config import ConfigError
from baton.common.model import AttentionBackend, CausalLM
from baton.train.backends.base import Layout, StepResult, step_loss
from baton.train.config import TrainConfig
from baton.train.distributed import Dist
from baton.train.parallel import checkpoint
from baton.train.parallel.layout import ParallelConfig, check_layout, data_parallel_size
from baton.train.parallel.mesh import build_mesh
from baton.train.parallel.parallelize import Parallel3D

LAYOUT_FILE = "parallel_layout.json"


class Torch3DBackend:
    def __init__(
        self,
        cfg: TrainConfig,
        model: CausalLM,
        attn: AttentionBackend,
        dist: Dist,
        par: ParallelConfig | None = None,
        pretrained: Any = None,
    ):
        """`pretrained` (init_from): `model` is meta-built and each rank's shards are filled from
        these PretrainedWeights once laid out (baton.train.pretrained)."""
        par = par if par is not None else cfg.parallel
        accum = cfg.accum_steps(data_parallel_size(par, dist.world_size))  # the pipeline's micro-batches
        self.layout3d = check_layout(par, model.config, dist.world_size, accum, cfg.data.seq_len)
        self.module, self.dist, self.grad_clip = model, dist, cfg.optim.grad_clip
        self.layout = Layout("torch3d", dist.world_size, precision=cfg.precision)
        self.engine = Parallel3D(
            model,
            build_mesh(self.layout3d),
            accum,
            cfg.optim,
            attn=attn,
            precision=cfg.precision,
            compile="inductor" if cfg.compile else None,
            materialize=pretrained.materialize if pretrained is not None else None,
        )

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        loss_sum = self.engine.forward_backward(micro_batches) * len(micro_batches)  # the replica's mean, summed
        loss = step_loss(self.dist, loss_sum, len(micro_batches))
        applied, norm = self.engine.clip_and_step(lr, self.grad_clip, math.isfinite(loss))
        return StepResult(loss, norm, applied)

    def eval_loss(self, batch: torch.Tensor) -> float:
        return self.engine.eval_loss(batch)

    def save(self, directory: Path) -> None:
        checkpoint.save(self.engine, directory / checkpoint.DCP_DIR)
        if self.dist.is_main:
            (directory / LAYOUT_FILE).write_text(json.dumps(asdict(self.layout3d), indent=2) + "\n")

    def load(self, directory: Path, saved: Layout) -> None:
        if saved.backend != "torch3d":
            raise ConfigError(
                f"{directory} was written by backend {saved.backend!r}; backend torch3d resumes only "
                "its own (DCP) checkpoints, at any layout. Resume it with its own backend, or start a "
                "new run from its weights: `baton export` it and set init_from to the export"
            )
        checkpoint.load(self.engine, directory / checkpoint.DCP_DIR)

    def memory(self) -> dict[str, Any]:
        return self.engine.memory()
