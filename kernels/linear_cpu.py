"""bfloat16 linear layers for CPU inference, with the weight reordered for oneDNN once, at load.

torch's `F.linear` on a bf16 CPU tensor goes to oneDNN, which reorders the plain [N, K] weight
into its blocked (AMX / AVX-512 BF16) layout on every call. At decode (M = the batch, 1-64 rows)
that reorder costs a third of the call or more (the weight is read, written and read again), and a bf16 GEMV came
out no faster than fp32's, which moves twice the bytes. `torch.ops.mkldnn._reorder_linear_weight`
(what inductor's freezing pass uses) does the reorder once; `_linear_pointwise` then multiplies
with it. Measured over the 110M serving model's linears (docs/benchmarks.md, "Serving speed"):
1.26-1.38x faster than bf16 F.linear at M = 1..64 and 1.11x at a prefill chunk (M = 2048), so one
packed copy replaces the plain weight for every M and serving keeps no second copy. A hand-written
AVX-512 BF16 GEMV (`_mm512_dpbf16_ps` over the row-major weight) was measured too: ~10% faster than
this at M = 1 but slower from M = 4 (no AMX), and it needs the plain weight beside the packed one,
so it was not kept.

Falls back to `F.linear` (`prepacked_available()` false) where oneDNN has no bf16 support on this
CPU, or with BATON_CPU_PACKED_LINEAR=0. CPU only: CUDA tensors never take this path.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

PACK_ROWS = 2048  # a prefill chunk (the serving benchmarks run 2,048 batched tokens per step)


def _mkldnn_bf16() -> bool:
    mk = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mk, "_reorder_linear_weight")
        and hasattr(mk, "_linear_pointwise")
        and bool(mk._is_mkldnn_bf16_supported())
    )


@functools.cache
def _supported() -> bool:
    try:
        return _mkldnn_bf16()
    except (RuntimeError, AttributeError):  # a torch built without oneDNN's ops
        return False


def prepacked_available() -> bool:
    """Whether bf16 CPU linears can run from a once-reordered oneDNN weight here (and may)."""
    return os.environ.get("BATON_CPU_PACKED_LINEAR", "1") != "0" and _supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] bf16 CPU weight in oneDNN's blocked layout (an opaque mkldnn tensor). oneDNN picks
    the layout for a batch size: the one for PACK_ROWS rows measured within 4% of the M = 1 layout
    at decode (M = 1, 8) and up to 1.4x faster than it at prefill (M = 64..2048, the down projection)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(
            f"pack_weight: a 2-D bfloat16 CPU weight, got {tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 times a `pack_weight` result, plus bias: F.linear's value (float32
    accumulation, one rounding to bf16). No autograd: inference only."""
    k = x.shape[-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, k), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The specification: the bf16 inputs multiplied in float32, rounded to bf16 once."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


class PackedLinear(nn.Module):
    """An inference-only nn.Linear whose weight lives in oneDNN's layout (`pack_weight`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """In place: every plain bf16 CPU nn.Linear (no hooks; its weight not shared with another
    module, as a tied LM head's is with the embedding) becomes a PackedLinear, so the plain weight
    is freed. Returns how many were packed; 0 where `prepacked_available()` is false."""
    if not prepacked_available():
        return 0
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    todo = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and not child._forward_hooks
        and not child._forward_pre_hooks
        and child.weight.device.type == "cpu"
        and child.weight.dtype == torch.bfloat16
        and id(child.weight) not in shared
    ]
    for parent, name, child in todo:
        setattr(parent, name, PackedLinear(child))
    return len(todo)
