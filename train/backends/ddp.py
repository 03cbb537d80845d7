"""Plain PyTorch: one process, or DistributedDataParallel when launched with several ranks.

Every rank holds the whole model and optimizer (16 bytes per parameter in fp32 with AdamW), so the
checkpoint is simply the universal state, written by rank 0.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from baton.common.model import AttentionBackend, CausalLM
from baton.train.backends import Layout, StepResult, lm_loss, param_groups, step_loss
from baton.train.config import TrainConfig
from baton.train.distributed import Dist
from baton.train.universal import UniversalState, read_any, write_universal


class DDPBackend:
    def __init__(self, cfg: TrainConfig, model: CausalLM, attn: AttentionBackend, dist: Dist):
        self.module, self.attn, self.dist = model, attn, dist
        self.grad_clip = cfg.optim.grad_clip
        self.layout = Layout("torch", dist.world_size)
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", dist.local_rank) if cuda else torch.device("cpu")
        model.to(self.device)
        if dist.world_size > 1:
            self.model = DistributedDataParallel(model, device_ids=[dist.local_rank] if cuda else None)
        else:
            self.model = model
        groups, self.group_names = param_groups(model, cfg.optim.weight_decay)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        self.named = dict(model.named_parameters())

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        losses = [
            self._forward_backward(mb, i == len(micro_batches) - 1, len(micro_batches))
            for i, mb in enumerate(micro_batches)
        ]
        loss = step_loss(self.dist, torch.stack(losses).sum(), len(micro_batches))
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else math.inf).item()
        applied = math.isfinite(loss) and math.isfinite(norm)
        if applied:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, norm, applied)

    def _forward_backward(self, batch: torch.Tensor, last: bool, accum: int) -> torch.Tensor:
        """One micro-batch; DDP reduces the gradients across ranks on the last one only."""
        sync = last or not isinstance(self.model, DistributedDataParallel)
        batch = batch.to(self.device)
        with contextlib.nullcontext() if sync else self.model.no_sync():
            loss = lm_loss(self.model(batch[:, :-1], attn=self.attn), batch)
            (loss / accum).backward()
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        self.module.eval()
        batch = batch.to(self.device)
        try:
            return lm_loss(self.module(batch[:, :-1], attn=self.attn), batch).item()
        finally:
            self.module.train()

    def universal_state(self) -> UniversalState:
        names = {p: n for n, p in self.named.items()}
        moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
        step = 0
        for p, st in self.optimizer.state.items():
            for key in moments:
                moments[key][names[p]] = st[key].cpu()
            step = int(st["step"])
        weights = {n: p.detach().cpu() for n, p in self.named.items()}
        return UniversalState(weights, moments["exp_avg"], moments["exp_avg_sq"], step)

    def save(self, directory: Path) -> None:
        if self.dist.is_main:
            write_universal(directory, self.universal_state())

    def load(self, directory: Path, saved: Layout) -> None:
        state = read_any(directory, saved.backend)
        with torch.no_grad():
            for n, p in self.named.items():
                p.copy_(state.weights[n])
        self.optimizer.state.clear()
        if state.step > 0:
            for n, p in self.named.items():  # AdamW keeps `step` as a float32 scalar tensor per parameter
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(state.step), dtype=torch.float32),
                    "exp_avg": state.exp_avg[n].to(p.device, copy=True),
                    "exp_avg_sq": state.exp_avg_sq[n].to(p.device, copy=True),
                }

    def memory(self) -> dict[str, Any]:
        """Bytes of model state on this rank, by kind and where it lives."""
        params = sum(p.numel() * p.element_size() for p in self.named.values())
        optim = sum(
            t.numel() * t.element_size()
            for st in self.optimizer.state.values()
            for t in st.values()
            if torch.is_tensor(t)
        )
        return {
            "accelerator": {"params": params, "grads": params, "optimizer": optim},
            "host": {},
            "nvme": {},
            "parameters": params // 4,
        }
