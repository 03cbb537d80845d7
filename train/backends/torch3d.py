"""3D parallelism (dp x pp x cp x tp) with torch.distributed's own tools, as a training backend.

The layout comes from the recipe's `parallel` section (baton.train.parallel.layout). The model is
parallelized from outside (baton.train.parallel.parallelize); checkpoints are DCP, written shard by
shard under whole-parameter names, so a run resumes at any other layout, and the plain-PyTorch
backend or `baton export` read them as whole tensors.

The training loop hands over a step's micro-batches one by one; they are buffered and run together
on the last one, because a pipeline schedule needs all of a step's micro-batches at once. The last
call returns their summed loss (the others 0), which is all the loop does with them: it sums.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from baton.common.config import ConfigError
from baton.common.model import AttentionBackend, CausalLM
from baton.train.backends import Layout, StepResult
from baton.train.config import TrainConfig
from baton.train.distributed import Dist
from baton.train.parallel import checkpoint
from baton.train.parallel.layout import ParallelConfig, check_layout, data_parallel_size
from baton.train.parallel.mesh import build_mesh
from baton.train.parallel.parallelize import Parallel3D

DCP_DIR = "dcp"  # the shards, inside the step checkpoint directory
LAYOUT_FILE = "parallel_layout.json"


class Torch3DBackend:
    def __init__(self, cfg: TrainConfig, model: CausalLM, attn: AttentionBackend, dist: Dist,
                 par: ParallelConfig | None = None):
        par = par if par is not None else cfg.parallel
        accum = cfg.accum_steps(data_parallel_size(par, dist.world_size))  # the pipeline's micro-batches
        self.layout3d = check_layout(par, model.config, dist.world_size, accum, cfg.data.seq_len)
        self.module, self.dist, self.grad_clip = model, dist, cfg.optim.grad_clip
        self.layout = Layout("torch3d", dist.world_size)
        self.engine = Parallel3D(model, build_mesh(self.layout3d), accum, cfg.optim, attn=attn)
        self._pending: list[torch.Tensor] = []

    def forward_backward(self, batch: torch.Tensor, last: bool) -> torch.Tensor:
        self._pending.append(batch)
        if not last:
            return torch.zeros((), device=self.engine.device)
        parts, self._pending = self._pending, []
        return self.engine.forward_backward(parts) * len(parts)

    def step(self, lr: float, loss_finite: bool) -> StepResult:
        applied, norm = self.engine.clip_and_step(lr, self.grad_clip, loss_finite)
        return StepResult(applied, norm)

    def eval_loss(self, batch: torch.Tensor) -> float:
        return self.engine.eval_loss(batch)

    def save(self, directory: Path) -> None:
        checkpoint.save(self.engine, directory / DCP_DIR)
        if self.dist.is_main:
            (directory / LAYOUT_FILE).write_text(json.dumps(asdict(self.layout3d), indent=2) + "\n")

    def load(self, directory: Path, saved: Layout) -> None:
        if saved.backend != "torch3d":
            raise ConfigError(f"{directory} was written by backend {saved.backend!r}; backend torch3d resumes only "
                              "its own (DCP) checkpoints, at any layout. Resume it with its own backend, or start "
                              "from its exported weights")
        checkpoint.load(self.engine, directory / DCP_DIR)

    def memory(self) -> dict[str, Any]:
        return self.engine.memory()

