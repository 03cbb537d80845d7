"""Helpers shared by the kernel modules: the dispatch rule, output allocation and launch sizing."""

from __future__ import annotations

import functools
import math

import torch
import triton

LOG2E = 1.4426950408889634  # kernels use exp2/log2 (one MUFU op); scores are pre-scaled by log2(e)

# Tests set this so every output and scratch buffer starts as NaN: an element a kernel forgot to
# write then fails the comparison instead of silently holding whatever torch.empty returned.
POISON = False


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on CUDA: the dispatchers then launch the Triton kernel."""
    return all(t.is_cuda for t in tensors)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Inference-only kernels (no backward) hand off to the torch path when autograd is recording."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def alloc(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, NaN-filled when POISON is set (tests)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON and out.is_floating_point():
        out.fill_(math.nan)
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full precision (tl.dot would round them to tf32); 16-bit inputs ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 8 elsewhere, e.g. under the interpreter)."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


next_pow2 = triton.next_power_of_2
cdiv = triton.cdiv
