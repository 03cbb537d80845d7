"""Activation recomputation, applied from outside the model (Megatron's definitions).

- selective: checkpoint only the attention core, the `attn(q, k, v, layer)` call of
  `Attention.forward` (QK^T, softmax, dropout, ·V). Its activations grow with s^2 but cost few
  FLOPs to recompute (Korthikanti et al. 2022). Done by wrapping the attention backend.
- full: checkpoint whole decoder layers (every N-th one), keeping only each layer's input.

Both use non-reentrant torch.utils.checkpoint, so gradients are the same as without recomputation
and parameter names (hence checkpoints) do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from baton.common.model import AttentionBackend, CausalLM, DenseCausalAttention
from baton.train.config import RecomputeConfig


class SelectiveRecompute:
    """An attention backend that recomputes the wrapped backend's core in the backward pass."""

    def __init__(self, inner: AttentionBackend):
        self.inner = inner

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any) -> torch.Tensor:
        return checkpoint(self.inner, q, k, v, layer, use_reentrant=False)


def apply_recompute(model: CausalLM, cfg: RecomputeConfig) -> AttentionBackend:
    """Set up recomputation on `model` in place; return the attention backend to train with."""
    attn = DenseCausalAttention()
    if cfg.mode == "selective":
        return SelectiveRecompute(attn)
    if cfg.mode == "full":
        for i, layer in enumerate(model.model.layers):
            if i % cfg.every_n_layers == 0:
                # An instance attribute shadows DecoderLayer.forward; module hooks (DDP, ZeRO-3) still run.
                layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    return attn


class _LiveStorages(TorchDispatchMode):
    """Records every storage that an op creates, to count what is still alive later."""

    def __init__(self) -> None:
        super().__init__()
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                if s.data_ptr() in inputs:  # a view or an in-place result: nothing new allocated
                    continue
                old = self.created.get(s.data_ptr())
                if old is None or old[0].expired():  # a freed storage's address can be reused
                    self.created[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        return out

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.created.values() if not ref.expired())


def activation_bytes(forward: Callable[[], torch.Tensor]) -> int:
    """Bytes created by `forward()` that are still alive when it returns: what autograd (or a
    checkpoint) keeps for the backward pass, plus the returned loss itself."""
    mode = _LiveStorages()
    with mode:
        loss = forward()
    live = mode.live_bytes()
    del loss
    return live


class EagerAttention:
    """The unfused attention core (scores, mask, softmax, ·V materialised), i.e. what Megatron's
    activation formula assumes. torch's SDPA on CPU is flash-style and keeps no s x s tensors, so
    selective recomputation only pays off with this core; benchmarks compare both."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = q.shape[2]
        i = torch.arange(s, device=q.device)
        dist = i[:, None] - i[None, :]
        allowed = dist >= 0
        if layer.sliding_window is not None:
            allowed &= dist < layer.sliding_window
        scores = (q @ k.transpose(-1, -2)) * layer.scaling
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return (probs @ v).transpose(1, 2)
