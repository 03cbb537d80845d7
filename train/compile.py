"""`compile: true`: each decoder layer's forward compiled with torch.compile (torchtitan's per-block
compile), applied after recomputation and before data parallelism.

Per layer rather than the whole model: every layer has the same code, so dynamo compiles it once
and reuses the graph for the others (parameters are graph inputs), compile time stays that of one
block whatever the depth, and the wrappers around the layers - FSDP2's all-gather hooks, DDP's
reducer, DeepSpeed's engine, the pipeline schedule - stay eager. Only the layer's `forward` is
compiled (an instance attribute, as full recomputation sets): the module keeps its hooks outside
the compiled region and its parameter names (no `_orig_mod.` prefix), so checkpoints do not change.
Full recomputation's checkpoint and the attention core are traced into the graph, except Triton
FlashAttention, which launches its own kernels and runs eagerly inside it (torch.compiler.disable);
context parallelism's ring attention is left to dynamo (tests/train/test_compile.py checks the
numbers).

Tensor parallelism (DTensor plans) compiles too, with two adjustments for torch 2.13, each found
by comparing gradients with the eager run (tests/train/test_compile.py):
- A layer's input can be an AsyncCollectiveTensor (the vocab-parallel embedding's all-reduce or
  reduce-scatter, still in flight). Fed to a compiled graph as is, it either fails in the backward
  ('Tensor' object has no attribute '_local_tensor') or, waited on with `trigger_wait()`, cuts
  the autograd graph (the embedding got no gradient: the "wrong gradient norm" seen before). It
  is waited on in an autograd function that passes the gradient straight through.
- Full recomputation's checkpoint cannot be traced around DTensor activations (AOTAutograd
  asserts on the saved DTensors), so with tensor-parallel layers the checkpoint wraps the
  compiled forward instead of being compiled into it.
"""

from __future__ import annotations

import functools
import logging
import shutil

import torch
from baton.common.model import DecoderLayer, HybridDecoderLayer
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

COMPILERS = ("g++", "c++", "clang++")  # inductor's CPU code is C++


def cpu_compiler() -> str | None:
    return next((c for c in COMPILERS if shutil.which(c)), None)


class _Arrived(torch.autograd.Function):
    """An in-flight collective's result as a plain tensor, the gradient passed straight through."""

    @staticmethod
    def forward(ctx, x: AsyncCollectiveTensor) -> torch.Tensor:
        return x.trigger_wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _compiled(forward, backend: str):
    graph = torch.compile(forward, backend=backend)

    def run(x: torch.Tensor, *args):
        return graph(_Arrived.apply(x) if isinstance(x, AsyncCollectiveTensor) else x, *args)

    return run


def _is_checkpointed(forward) -> bool:
    return isinstance(forward, functools.partial) and forward.func is checkpoint


def compile_layers(module: nn.Module, backend: str = "inductor") -> int:
    """Compile the forward of every decoder layer under `module` in place; returns how many. (A
    hybrid's mixer and attention layers are two graphs.)"""
    layers = [m for m in module.modules() if isinstance(m, (DecoderLayer, HybridDecoderLayer))]
    for layer in layers:
        forward = layer.forward
        sharded = any(isinstance(p, DTensor) for p in layer.parameters())  # tensor parallel (FSDP2 comes after)
        if sharded and _is_checkpointed(forward):
            layer.forward = functools.partial(checkpoint, _compiled(forward.args[0], backend), **forward.keywords)
        else:
            layer.forward = _compiled(forward, backend)
    return len(layers)
