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
numbers). Tensor parallelism is refused by the recipe check: see train/config.py.
"""

from __future__ import annotations

import logging
import shutil

import torch
from torch import nn

from baton.common.model import DecoderLayer

log = logging.getLogger(__name__)

COMPILERS = ("g++", "c++", "clang++")  # inductor's CPU code is C++


def cpu_compiler() -> str | None:
    return next((c for c in COMPILERS if shutil.which(c)), None)


def compile_layers(module: nn.Module, backend: str = "inductor") -> int:
    """Compile the forward of every DecoderLayer under `module` in place; returns how many."""
    layers = [m for m in module.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend)
    return len(layers)
