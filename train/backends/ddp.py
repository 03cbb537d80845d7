"""Plain PyTorch: one process, or DistributedDataParallel when launched with several ranks.

Every rank holds the whole model and optimizer (16 bytes per parameter in fp32 with AdamW), so the
checkpoint is simply the universal state, written by rank 0. bf16/fp16 run the forward under
torch.autocast: the parameters (the optimizer's master weights) and their gradients stay float32,
so DDP all-reduces float32 gradients. fp16 scales the loss (torch.amp.GradScaler): gradients are
unscaled before clipping, and a step whose gradients overflowed is skipped and the scale halved.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from baton.common.model import AttentionBackend, CausalLM
from baton.train.backends.base import Layout, StepResult, autocast, lm_loss, loss_scaler, param_groups, step_loss
from baton.train.backends.readers import read_any
from baton.train.compile import compile_layers
from baton.train.config import TrainConfig
from baton.train.distributed import Dist
from baton.train.early_exit import apply_early_exit
from baton.train.universal import UniversalState, write_universal
from torch.nn.parallel import DistributedDataParallel

SCALER_FILE = "loss_scaler.json"  # fp16: GradScaler's state, beside the universal state


class DDPBackend:
    def __init__(self, cfg: TrainConfig, model: CausalLM, attn: AttentionBackend, dist: Dist):
        self.module, self.attn, self.dist = model, attn, dist
        self.grad_clip = cfg.optim.grad_clip
        self.precision = cfg.precision
        self.layout = Layout("torch", dist.world_size, precision=cfg.precision)
        self.device = dist.device
        self.scaler = loss_scaler(self.device, cfg)
        model.to(self.device)
        # LayerSkip (early_exit: section): hooks on the layers, their loss in _forward_backward
        self.early_exit = apply_early_exit(model, cfg.early_exit, cfg.max_steps, cfg.seed * 1000 + dist.rank)
        if cfg.compile:  # each layer's forward, before DDP wraps the model (its reducer stays eager)
            compile_layers(model)
        if dist.world_size > 1:
            cuda = self.device.type == "cuda"
            self.model = DistributedDataParallel(model, device_ids=[self.device.index] if cuda else None)
        else:
            self.model = model
        groups, self.group_names = param_groups(model, cfg.optim.weight_decay)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        self.named = dict(model.named_parameters())
        # Persistent buffers (DeepSeek-V3's score-correction biases, moved outside the gradient by
        # baton.train.balancing) are training state too: saved and restored with the weights.
        saved = model.state_dict().keys()
        self.buffers = {n: b for n, b in model.named_buffers() if n in saved}

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        losses = [
            self._forward_backward(mb, i == len(micro_batches) - 1, len(micro_batches))
            for i, mb in enumerate(micro_batches)
        ]
        loss = step_loss(self.dist, torch.stack(losses).sum(), len(micro_batches))
        scale = None
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.unscale_(self.optimizer)  # the true gradients (inf/nan where the scaled ones overflowed)
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip if self.grad_clip > 0 else math.inf).item()
        applied = math.isfinite(loss) and math.isfinite(norm)
        if applied:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()  # halved after an overflow (found by unscale_), else counts towards doubling
        self.optimizer.zero_grad(set_to_none=True)
        overflow = scale is not None and not applied and math.isfinite(loss)
        return StepResult(loss, norm, applied, scale, overflow)

    def _forward_backward(self, batch: torch.Tensor, last: bool, accum: int) -> torch.Tensor:
        """One micro-batch; DDP reduces the gradients across ranks on the last one only."""
        sync = last or not isinstance(self.model, DistributedDataParallel)
        batch = batch.to(self.device)
        with contextlib.nullcontext() if sync else self.model.no_sync():
            with autocast(self.device, self.precision):
                logits = self.model(batch[:, :-1], attn=self.attn)
                if self.early_exit is None:
                    total = loss = lm_loss(logits, batch)
                else:  # the exits' weighted loss is trained; the final layer's is logged
                    total, loss = self.early_exit.loss(logits, batch)
            scaled = total / accum
            (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        self.module.eval()
        batch = batch.to(self.device)
        try:
            with autocast(self.device, self.precision):
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
        weights = {n: p.detach().cpu() for n, p in (self.named | self.buffers).items()}
        return UniversalState(weights, moments["exp_avg"], moments["exp_avg_sq"], step)

    def save(self, directory: Path) -> None:
        if self.dist.is_main:
            write_universal(directory, self.universal_state())
            if self.scaler is not None:
                (directory / SCALER_FILE).write_text(json.dumps(self.scaler.state_dict()) + "\n")

    def load(self, directory: Path, saved: Layout) -> None:
        """Any checkpoint's float32 weights and moments; fp16's loss scale too where the checkpoint
        has one of this backend's (else the scaler starts afresh, as in a new run)."""
        if self.scaler is not None and (directory / SCALER_FILE).is_file():
            self.scaler.load_state_dict(json.loads((directory / SCALER_FILE).read_text()))
        state = read_any(directory, saved.backend)
        with torch.no_grad():
            for n, p in (self.named | self.buffers).items():
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
