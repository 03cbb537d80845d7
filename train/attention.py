"""The recipe's `attention:` choice: which attention core the decoder layers train with.

- sdpa (default): torch's scaled_dot_product_attention (common.model.DenseCausalAttention); on
  CUDA it dispatches to FlashAttention / memory-efficient kernels, on CPU to a flash-style loop.
- triton: Baton's own FlashAttention-2 forward and backward (kernels/flash_attention.py and
  flash_attention_bwd.py) through their autograd.Function: the [B, S] batch is packed as B
  sequences of S tokens (cu_seqlens), causal, GQA and sliding windows handled in the kernel.
  CUDA only - except under TRITON_INTERPRET=1, where the interpreter runs the same kernels on CPU
  tensors (slowly, and exact only in fp32: it mis-rounds bf16), which is how tests check it here.
- eager: scores, mask, softmax and ·V materialised (EagerAttention): the unfused core
  Megatron's activation formula assumes; the one core selective recomputation pays off with.

All three are `AttentionBackend`s (common.model) with the same numbers up to rounding, Gemma 2's
soft-capped scores and gpt-oss's attention sinks included; context parallelism replaces the core
with its ring attention, so it takes only the default (and only models without those two).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from baton.common.model import AttentionBackend, DenseCausalAttention
from baton.kernels.attention_torch import attention_math
from baton.kernels.flash_attention import flash_attn_varlen_triton

ATTENTION_BACKENDS = ("sdpa", "triton", "eager")
FUSED = ("sdpa", "triton")  # cores that never materialise the s x s scores


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonFlashAttention:
    """Baton's Triton FlashAttention-2 (forward + backward) as a training attention core."""

    @torch.compiler.disable  # Triton launches with host-side grids: run them eagerly inside a compiled layer
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any) -> torch.Tensor:
        b, s, hq, d = q.shape
        # The kernel takes one dtype; under autocast that is the compute dtype, as SDPA would be cast to.
        dev = q.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
        q, k, v = (t.to(dtype).reshape(b * s, t.shape[2], d) for t in (q, k, v))
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        # Soft-capping (Gemma 2) and sinks (gpt-oss) run in the kernel, the sinks' gradient included.
        extra: dict[str, Any] = {}
        if getattr(layer, "logit_softcap", None):
            extra["softcap"] = layer.logit_softcap
        if getattr(layer, "sinks", None) is not None:
            extra["sinks"] = layer.sinks
        out = flash_attn_varlen_triton(
            q,
            k,
            v,
            cu,
            cu,
            s,
            s,
            causal=True,
            sliding_window=layer.sliding_window,
            softmax_scale=layer.scaling,
            **extra,
        )
        return out.view(b, s, hq, d)


class EagerAttention:
    """The unfused attention core (scores, mask, softmax, ·V materialised), i.e. what Megatron's
    activation formula assumes. torch's SDPA on CPU is flash-style and keeps no s x s tensors, so
    selective recomputation only pays off with this core; benchmarks compare both."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        s = q.shape[2]
        i = torch.arange(s, device=q.device)
        dist = i[:, None] - i[None, :]
        allowed = dist >= 0
        if layer.sliding_window is not None:
            allowed &= dist < layer.sliding_window
        sinks, cap = getattr(layer, "sinks", None), getattr(layer, "logit_softcap", None)
        if sinks is not None or cap:  # Gemma 2's soft-capped scores, gpt-oss's sinks: the model's own math
            return attention_math(q, k, v, layer.scaling, allowed, sinks, cap or 0.0).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * layer.scaling
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return (probs @ v).transpose(1, 2)


CORES: dict[str, Callable[[], AttentionBackend]] = {
    "sdpa": DenseCausalAttention,
    "triton": TritonFlashAttention,
    "eager": EagerAttention,
}


def attention_core(name: str) -> AttentionBackend:
    """The attention core the recipe names (recompute.apply_recompute may wrap it)."""
    return CORES[name]()


def check_attention(need: Callable[[bool, str], None], attention: str, precision: str, cp: int) -> None:
    """What the chosen core can run here; called by the recipe checks (baton.train.validate)."""
    need(attention in ATTENTION_BACKENDS, f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
    need(
        attention == "sdpa" or cp == 1,
        f"attention {attention!r} with parallel.cp {cp}: context parallelism runs its own ring attention "
        "core over the sequence shards; leave attention at sdpa",
    )
    if attention != "triton":
        return
    if torch.cuda.is_available():
        return
    need(
        triton_interpreted(),
        "attention triton runs Baton's Triton FlashAttention kernels, which need a CUDA GPU (none is "
        "available); use attention: sdpa (TRITON_INTERPRET=1 runs them on CPU for tests, slowly)",
    )
    need(
        precision == "fp32",
        f"attention triton under TRITON_INTERPRET=1 (no GPU) with precision {precision}: the Triton "
        "interpreter rounds bf16/fp16 dots wrongly, so only fp32 is a faithful check; use precision: fp32",
    )
