"""Fused projections for serving: q/k/v as one GEMM, gate/up as one GEMM (vLLM's QKVParallelLinear
and MergedColumnParallelLinear), applied from outside the shared model like fuse_residual_norms.

The weights are concatenated once when the runner is set up; checkpoints keep HF's separate
tensors. One [T, h] x [h, q+2kv] GEMM instead of three small ones reads the activations once and
gives the GEMM a wider N, which matters most at decode shapes (T = the batch). Each output
column is the same dot product as before. Only plain nn.Linear projections on one device and
dtype are fused: quantized layers, layers with hooks (tensor parallelism's all-reduce) and MoE
experts are left as they are; a tensor-parallel rank's column shards are plain linears and fuse.
"""

from __future__ import annotations

import torch
from baton.common.model import MLP, Attention, DecoderLayer
from baton.common.moe import pack_experts
from torch import nn


class FusedQKVAttention(Attention):
    """Attention whose q/k/v projections are one `qkv_proj` (rows: q, then k, then v)."""

    qkv_proj: nn.Linear

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        return self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)


class FusedMLP(MLP):
    """A gated MLP whose gate and up projections are one `gate_up_proj` (rows: gate, then up)."""

    gate_up_proj: nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(self.gated(gate, up))


def _plain(*mods: nn.Module) -> bool:
    """Plain linears without hooks, on one device and dtype: the ones whose weights can be concatenated."""
    if not all(type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks for m in mods):
        return False
    w = [m.weight for m in mods]
    biased = {m.bias is not None for m in mods}
    return len(biased) == 1 and len({(t.device, t.dtype) for t in w}) == 1 and w[0].device.type != "meta"


@torch.no_grad()
def _concat(mods: list[nn.Linear]) -> nn.Linear:
    w = torch.cat([m.weight for m in mods])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=mods[0].bias is not None, device=w.device, dtype=w.dtype)
    fused.weight.copy_(w)
    if fused.bias is not None:
        fused.bias.copy_(torch.cat([m.bias for m in mods]))
    return fused.requires_grad_(False)


def fuse_projections(model: nn.Module) -> nn.Module:
    """In place: every decoder layer's q/k/v and gate/up projections that can be fused, are; and the
    experts of every MoE layer are packed into stacked tensors for the grouped GEMM (common/moe.py)."""
    pack_experts(model)
    for layer in model.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        a = layer.self_attn
        if type(a) is Attention and _plain(a.q_proj, a.k_proj, a.v_proj):
            a.qkv_proj = _concat([a.q_proj, a.k_proj, a.v_proj])
            del a.q_proj, a.k_proj, a.v_proj
            a.__class__ = FusedQKVAttention
        m = getattr(layer, "mlp", None)
        if type(m) is MLP and _plain(m.gate_proj, m.up_proj):
            m.gate_up_proj = _concat([m.gate_proj, m.up_proj])
            del m.gate_proj, m.up_proj
            m.__class__ = FusedMLP
    return model
