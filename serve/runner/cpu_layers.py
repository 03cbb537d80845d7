"""A CPU step's decoder layers without the Python between the kernels.

Through the shared model a decoder layer is ~15 kernel calls (RMSNorm, the fused q/k/v and gate/up
linears, rotary, the KV write, paged attention, SwiGLU, the residual adds), and each one passes
through nn.Module.__call__, a dispatcher that picks Triton, C++ or torch, and shape checks. At a
decode step those wrappers cost more than several of the kernels they wrap: on the 25M serving
model in bf16 at batch 64 the forward was 10.0 ms, of which 6.5 ms linears, ~1.2 ms C++ kernels and
~2.3 ms left over (by subtraction) for the Python around them; this path made the decode step 1.10x (bf16) / 1.14x (fp32) faster
at batch 64 and 1.34x at batch 1 (docs/benchmarks.md, "A CPU step's layers without the modules' Python").

`bind` looks at each layer once, when the runner is built, and hands what its kernels need to the
C++ stack (kernels/csrc/decoder_cpu.cpp): the oneDNN-packed weights (called as the bare
`mkldnn::_linear_pointwise` op) or MKL's, the norm weights and the KV pools. `run` is then one C++
call for all the layers of a step, which carries the residual between layers so that the next
layer's input norm does the add in its one pass (vLLM's residual passing). The kernels, their order
and every rounding are the modules' own, so the output is bit for bit the modules' forward
(tests/serve/test_cpu_layers.py); anything else, a step with a speculative tree, a quantized KV
cache, a layer with hooks (tensor parallelism's all-reduce, a test's probe) or of another kind
(MoE, Mamba), goes through the modules as before.
One C++ call instead of the Python loop over the same kernels (in-process A/B, the two alternating,
25M bf16): batch-64 decode step 11.78 -> 11.44 ms (median), batch 1 2.65 -> 2.27 ms; 110M bf16 at
batch 64 39.5 -> 38.9 ms. `CpuHead` does the same for the sampled rows' final norm and LM head,
and the step's cos/sin come from tables over the positions seen (`CpuLayers.cos_sin`): together
25M bf16 11.21 -> 10.99 ms a step at batch 64, 2.97 -> 2.70 at batch 1. BATON_CPU_LAYERS=0 turns
all of it off (to measure one against the other).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from baton.common.model import DecoderLayer, RMSNorm
from baton.common.rope import rotary_cos_sin
from baton.kernels.cpu_extension import cpu_kernels
from baton.kernels.linear_cpu import PackedLinear, sgemm_compute_address
from baton.serve.runner.attention import AttentionMetadata, PagedAttention
from baton.serve.runner.fusion import FusedMLP, FusedQKVAttention
from torch import nn

ENV = "BATON_CPU_LAYERS"


def _linear(mod: nn.Module, ck) -> object | None:
    """The C++ stack's handle on a linear layer: Baton's GEMM or the bare oneDNN op over a packed
    weight, MKL's packed SGEMM, or F.linear's op; None for any other kind of layer (quantized,
    sharded ...)."""
    if type(mod) is PackedLinear:
        p = mod.packed
        address = sgemm_compute_address() if p.kind == "mkl" else 0
        return ck.CpuLinear(p.kind, p.data, mod.bias, p.out_features, p.in_features, address)
    if type(mod) is nn.Linear:
        return ck.CpuLinear("plain", mod.weight, mod.bias, mod.out_features, mod.in_features)
    return None


@dataclass
class BoundLayer:
    """One decoder layer as the C++ stack holds it."""

    layer: DecoderLayer
    modules: list[nn.Module]  # the layer and its submodules: a hook on any sends the step to the modules
    id: int  # in the stack


def _bind_layer(layer: nn.Module, kv_caches, stack, ck) -> BoundLayer | None:
    if type(layer) is not DecoderLayer or not layer.fuse_residual_norm:
        return None
    a, m = layer.self_attn, getattr(layer, "mlp", None)
    if type(a) is not FusedQKVAttention or type(m) is not FusedMLP or m.act != "silu":
        return None
    if a.qk_norm or a.sinks is not None or a.logit_softcap or a.rope_index is not None:
        return None  # the C++ layer is Llama's dataflow; the newer families' options run through the modules
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or n.offset for n in norms):
        return None
    lins = [_linear(x, ck) for x in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
    pools = kv_caches[a.layer_idx]
    if any(f is None for f in lins) or pools is None:
        return None
    i = stack.add(
        norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps, *lins, a.num_heads, a.num_kv_heads,
        a.head_dim, m.down_proj.in_features, a.scaling, a.sliding_window or 0, *pools,
    )  # fmt: skip
    return BoundLayer(layer, list(layer.modules()), i)


class CpuLayers:
    """The bound layers of a CPU runner (`bind`), run for a step by `run`."""

    def __init__(self, bound: dict[int, BoundLayer], stack, attn: PagedAttention):
        self.bound, self.stack, self.attn = bound, stack, attn
        self._tables: tuple | None = None  # (key, cos, sin): every position up to the largest seen

    def cos_sin(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        """rotary_cos_sin's values for `positions` [T], gathered from tables of all positions up to
        the largest seen so far (vLLM's cos_sin_cache): two gathers a step instead of its seven ops
        (~60 us at a 64-row decode step). The tables are rotary_cos_sin's own output over
        arange(n), the same float32 products and cos/sin, so the values are identical."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        key = (id(inv_freq), inv_freq._version, dtype, positions.device)
        t = self._tables
        if t is None or t[0] != key or t[1].shape[0] < need:
            n = max(need, 2 * t[1].shape[0] if t is not None and t[0] == key else 0, 256)
            t = self._tables = (key, *rotary_cos_sin(inv_freq, torch.arange(n, device=positions.device), dtype))
        return t[1].index_select(0, positions), t[2].index_select(0, positions)

    def takes(self, layers: list[nn.Module], md: AttentionMetadata) -> bool:
        """Whether this step's `layers` can run here: all bound, no tree to verify, no hooks."""
        if md.trees or self.attn.kv_cache_dtype != "auto" or not layers:
            return False
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        for layer in layers:
            b = self.bound.get(id(layer))
            if b is None or any(m._forward_hooks or m._forward_pre_hooks for m in b.modules):
                return False
        return True

    def run(
        self, layers: list[nn.Module], x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        """x [1, T, hidden] through `layers` (all taken, see `takes`), as run_layers would; the
        backend's query_rows layer, if among them, runs through its module (the rows it answers)."""
        cos, sin = self.cos_sin(inv_freq, positions.view(-1), x.dtype)
        # Every row is one query over its sequence's cache up to itself (see AttentionMetadata.rows_over_cache).
        tables, lens = md.rows_over_cache if md.num_prefills else (md.decode_block_tables, md.decode_context_lens)
        step = (cos, sin, tables, lens.contiguous(), md.slot_mapping, md.window_in_cache)
        trim = self.attn.query_rows_layer if self.attn.query_rows is not None else None
        h, ids = x[0], []
        for layer in layers:
            if layer.self_attn.layer_idx == trim:  # the rows it answers: through the module
                h = self.stack.run(h, ids, *step) if ids else h
                h, ids = layer(h.unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0), self.attn)[0], []
            else:
                ids.append(self.bound[id(layer)].id)
        return (self.stack.run(h, ids, *step) if ids else h).unsqueeze(0)


class CpuHead:
    """The final norm and the LM head of a CPU step's sampled rows, as ModelRunner.head computes
    them, without the modules' Python (~0.1 ms at a step: the norm's dispatcher, packed_linear's
    checks): the same C++ RMSNorm and the same linear op, so the same logits bit for bit."""

    def __init__(self, norm: RMSNorm, lm_head: nn.Module, linear, kernels):
        self.modules, self.norm, self.linear, self.kernels = (norm, lm_head), norm, linear, kernels

    def takes(self) -> bool:
        """No hooks on the norm or the head (a probe, a sharded vocabulary's gather), none global."""
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, normalised rows) of x [rows, hidden]."""
        y = self.kernels.rms_norm(x, self.norm.weight, self.norm.eps, None)[0]
        return self.linear(y), y


def bind_head(norm: nn.Module, lm_head: nn.Module, device: torch.device, dtype: torch.dtype) -> CpuHead | None:
    """The runner's final norm and LM head bound for `CpuHead`, or None where bind() would not apply."""
    if os.environ.get(ENV, "1") == "0" or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    ck = cpu_kernels()
    if ck is None or type(norm) is not RMSNorm or norm.offset or norm.weight.dtype != dtype:
        return None
    linear = _linear(lm_head, ck)
    return None if linear is None else CpuHead(norm, lm_head, linear, ck)


def bind(layers: list[nn.Module], attn: object, device: torch.device, dtype: torch.dtype) -> CpuLayers | None:
    """The runner's layers bound for `CpuLayers.run`, or None where this path does not apply (not
    CPU float32/bfloat16, no C++ kernels, another attention backend, BATON_CPU_LAYERS=0)."""
    switch = os.environ.get(ENV, "1")
    if switch not in ("0", "1"):
        raise ValueError(
            f"{ENV}={switch!r}: '1' (the default) runs CPU steps through this path, '0' through the modules"
        )
    if switch == "0" or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if type(attn) is not PagedAttention or attn.kv_cache_dtype != "auto" or cpu_kernels() is None:
        return None
    ck = cpu_kernels()
    stack = ck.CpuDecoderLayers()
    bound = {id(x): b for x in layers if (b := _bind_layer(x, attn.kv_caches, stack, ck)) is not None}
    return CpuLayers(bound, stack, attn) if bound else None
