"""Activation recomputation, applied from outside the model (Megatron's definitions).

- selective: checkpoint only the attention core, the `attn(q, k, v, layer)` call of
  `Attention.forward` (QK^T, softmax, dropout, ·V). Its activations grow with s^2 but cost few
  FLOPs to recompute (Korthikanti et al. 2022). Done by wrapping the attention backend.
- full: checkpoint whole decoder layers (every N-th one), keeping only each layer's input.

Selective recomputation exists for the s x s scores and softmax of an unfused core (`attention:
eager`). A fused core (sdpa, triton) never materialises them: checkpointing it would free only its
output copy and cost a second flash forward. So with a fused core, selective mode says so at
start-up and recomputes the other cheap, memory-heavy pieces Megatron-Core's selective mode can
target instead (its `layernorm` and activation modules): every RMSNorm of every layer (two, or
four in Gemma's sandwich layout, and the q/k norms of Qwen3, Gemma 3 and OLMo 2) and the gated
activation of every MLP and expert (SwiGLU, Gemma's GeGLU, gpt-oss's clamped SwiGLU) - elementwise
work whose intermediates (x·rstd, act(gate): [b, s, h] and [b, s, intermediate] per layer) are freed
and recomputed for a few FLOPs.

All use non-reentrant torch.utils.checkpoint, so gradients are the same as without recomputation
and parameter names (hence checkpoints) do not change.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from baton.common.model import MLP, AttentionBackend, CausalLM, RMSNorm
from baton.common.moe import Expert, GptOssExperts, Qwen3Expert
from baton.kernels import swiglu
from baton.train.attention import FUSED, EagerAttention, attention_core  # noqa: F401 (EagerAttention: callers import it here)
from baton.train.config import RecomputeConfig
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)


class SelectiveRecompute:
    """An attention backend that recomputes the wrapped backend's core in the backward pass."""

    def __init__(self, inner: AttentionBackend):
        self.inner = inner

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any) -> torch.Tensor:
        return checkpoint(self.inner, q, k, v, layer, use_reentrant=False)


def _checkpointed(fn: Callable[..., Any]) -> Callable[..., Any]:
    return functools.partial(checkpoint, fn, use_reentrant=False)


class _RecomputedNorm(RMSNorm):
    """RMSNorm whose intermediates are recomputed in the backward pass."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return checkpoint(super().forward, x, residual, use_reentrant=False)


class _RecomputedMLP(MLP):
    """MLP.forward with the gated activation checkpointed (act(gate) is not kept for the backward):
    SwiGLU or Gemma's GeGLU, whichever the MLP computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(checkpoint(self.gated, self.gate_proj(x), self.up_proj(x), use_reentrant=False))


class _RecomputedExpert(Expert):
    """Expert.forward (Mixtral's w1/w3/w2) with the activation checkpointed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(checkpoint(swiglu, self.w1(x), self.w3(x), use_reentrant=False))


class _RecomputedQwen3Expert(Qwen3Expert):
    """Qwen3Expert.forward with the activation checkpointed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(checkpoint(swiglu, gate, up, use_reentrant=False))


class _RecomputedGptOssExperts(GptOssExperts):
    """gpt-oss's stacked experts with the clamped SwiGLU checkpointed (its grouped GEMMs unchanged)."""

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().activation, gate_up, use_reentrant=False)


RECOMPUTED = {
    RMSNorm: _RecomputedNorm,
    MLP: _RecomputedMLP,
    Expert: _RecomputedExpert,
    Qwen3Expert: _RecomputedQwen3Expert,
    GptOssExperts: _RecomputedGptOssExperts,
}


def recompute_elementwise(model: torch.nn.Module) -> None:
    """Selective recomputation for a fused attention core: every RMSNorm and gated activation is
    recomputed in the backward pass. Each module's class becomes a subclass with that forward (state,
    names and hooks unchanged), so every layer runs the same code and torch.compile makes one graph."""
    for m in model.modules():
        if type(m) in RECOMPUTED:
            m.__class__ = RECOMPUTED[type(m)]


def apply_recompute(model: CausalLM, cfg: RecomputeConfig, attention: str = "sdpa") -> AttentionBackend:
    """Set up recomputation on `model` in place; return the attention backend (`attention`: the
    recipe's core, see baton.train.attention) to train with."""
    attn = attention_core(attention)
    if cfg.mode == "selective":
        if attention not in FUSED:
            return SelectiveRecompute(attn)
        log.warning(
            "recompute.mode selective with attention %s: the fused core keeps no s x s scores, so recomputing it "
            "would save only its output; recomputing every RMSNorm and SwiGLU activation instead (attention: eager "
            "is the core Megatron's selective recomputation is for; recompute.mode full keeps least)",
            attention,
        )
        recompute_elementwise(model)
        return attn
    if cfg.mode == "full":
        for i, layer in enumerate(model.model.layers):
            if i % cfg.every_n_layers == 0:
                # An instance attribute shadows DecoderLayer.forward; module hooks (DDP, ZeRO-3) still run.
                layer.forward = _checkpointed(layer.forward)
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
