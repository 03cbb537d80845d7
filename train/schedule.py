"""The learning-rate schedule, defined once: linear warmup, then cosine decay (nanoGPT's). The
trainer follows it from the recipe's optim section, the Medusa heads from their own settings."""

from __future__ import annotations

import math

from baton.train.config import TrainConfig


def warmup_cosine(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The rate of 0-based `step`: linear warmup to `lr` over `warmup_steps`, then cosine decay
    to `min_lr` at `total_steps`, and `min_lr` after."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The recipe's rate: warmup to optim.lr, cosine to optim.min_lr at max_steps."""
    o = cfg.optim
    return warmup_cosine(step, o.lr, o.min_lr, o.warmup_steps, cfg.max_steps)
