"""Expert parallelism (parallel.ep): each MoE layer's experts dealt out over an ep sub-group of the
data-parallel ranks, tokens sent to their experts' ranks and back with all_to_all_single.

Layout (Megatron's and torchtitan's): dp = edp x ep. The router, attention and every dense
parameter stay data-parallel over all of dp (FSDP2 over dp x cp, as without EP); rank r of an ep
group holds experts [r*E/ep, (r+1)*E/ep) whole, FSDP2-sharded over its expert-data-parallel group
(edp: the ranks with the same ep index). Each rank routes its own tokens, so the ep ranks of a
group hold different tokens, as data parallelism gives them.

Per MoE layer: the token-slots are sorted by expert (hence by destination rank); the per-expert
counts are exchanged first (one all_to_all of E integers, and the layer's one host sync for the
splits); the token rows go out by all_to_all_single with those variable splits; the receiver
regroups them by local expert and runs the grouped compute shared with the serving side
(MoE.run_experts: one matmul chain per expert batch); the reverse all_to_all_single brings the
outputs back, where they are weighted and summed exactly as without EP. The autograd of the
exchange is the reverse exchange (_AllToAll).

Gradients: an expert's gradient on its holder already sums the contributions of every ep peer's
tokens (the backward all-to-all delivers them), so the edp reduce-scatter divides by dp, not by
edp, to give the mean over all data-parallel ranks, like every dense gradient. Every held expert
runs on every step, with zero tokens too (MoE.always_run_experts): their FSDP2 all-gathers and
reduce-scatters then match across the edp group whatever the routing.

With tensor parallelism (tensor_parallel.py) the MoE block is not split: it receives the gathered
sequence and runs replicated over the tp ranks, so each tp rank routes the same tokens and its
ep group (the ranks with the same tp index) exchanges them as above; the router losses and every
gradient are then the same on all tp ranks, as one process would compute them.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from baton.common.moe import MoE
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# In the name of every expert parameter: Mixtral's block_sparse_moe.experts.<e>., Qwen3-MoE's and
# DeepSeek-V3's mlp.experts.<e>. (not DeepSeek's mlp.shared_experts: dense, data-parallel like an MLP).
EXPERT_KEY = re.compile(r"\.(block_sparse_moe|mlp)\.experts\.\d+\.")


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `in_splits` to the group's ranks; rows received by `out_splits`.
    Backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _NoExpert(nn.Module):
    """Stands where another ep rank's expert is: no parameters, so the held experts keep their
    whole-model names (experts.<e>.w1.weight) in state dicts and checkpoints."""


class ExpertParallelMoE(MoE):
    """A training MoE whose experts are spread over `ep_group` (set by apply_ep)."""

    always_run_experts = True
    ep_group: dist.ProcessGroup
    ep_size: int
    local_experts: range

    def held_experts(self) -> range:
        return self.local_experts

    def combine(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        num, ep = len(self.experts), self.ep_size
        per = num // ep
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # slots by expert, so by destination rank
        counts = torch.bincount(flat, minlength=num)
        recv = torch.empty_like(counts)  # recv[p * per + j]: ep peer p's slots for my expert j
        dist.all_to_all_single(recv, counts, group=self.ep_group)
        sizes = torch.cat([counts, recv]).tolist()  # the one host sync
        sent, got = sizes[:num], sizes[num:]
        send_splits = [sum(sent[p * per : (p + 1) * per]) for p in range(ep)]
        recv_splits = [sum(got[p * per : (p + 1) * per]) for p in range(ep)]
        token_idx = order // self.top_k
        received = _AllToAll.apply(x[token_idx], recv_splits, send_splits, self.ep_group)
        # Received rows are peer-major; the grouped compute wants them expert-major.
        local_ids = torch.arange(per, device=x.device).repeat(ep).repeat_interleave(recv)
        perm = torch.argsort(local_ids, stable=True)
        per_expert = [sum(got[p * per + j] for p in range(ep)) for j in range(per)]
        ys = self.run_experts(received[perm], per_expert, self.local_experts)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        returned = _AllToAll.apply(ys[inverse], send_splits, recv_splits, self.ep_group)
        out = torch.zeros_like(x)
        out.index_add_(0, token_idx, (returned * weights.flatten()[order, None]).to(x.dtype))
        return out


_EP_CLASSES: dict[type, type] = {MoE: ExpertParallelMoE}


def expert_parallel_class(cls: type) -> type:
    """ExpertParallelMoE's dispatch over `cls`'s routing: DeepSeekMoE keeps its sigmoid, group-limited
    routing, its shared experts and its balancing statistics (only `combine` and `held_experts` change)."""
    if issubclass(cls, ExpertParallelMoE):
        return cls
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelMoE, cls), {})
    return _EP_CLASSES[cls]


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def apply_ep(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's share of every MoE layer's experts (the rest become _NoExpert) and
    route through all-to-all over `ep_mesh` (1-D)."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for moe in moe_layers(module):
        if not isinstance(moe.experts, nn.ModuleList):  # (check_layout refuses it first)
            raise ValueError(f"expert parallelism deals out expert modules; {type(moe.experts).__name__} stacks them")
        per = len(moe.experts) // ep
        moe.__class__ = expert_parallel_class(type(moe))
        moe.ep_group, moe.ep_size = ep_mesh.get_group(), ep
        moe.local_experts = range(rank * per, (rank + 1) * per)
        for e in range(len(moe.experts)):
            if e not in moe.local_experts:
                moe.experts[e] = _NoExpert()


def shard_experts(
    module: nn.Module, edp_mesh: DeviceMesh, dp: int, param_dtype: torch.dtype | None, reshard: bool
) -> None:
    """FSDP2 units for the held experts over the expert-data-parallel mesh, before the layers'
    own units (which then leave these parameters alone), with the layers' mixed precision.
    Gradients are summed over edp and divided by the whole dp degree (see the module docstring)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for moe in moe_layers(module):
        for e in moe.held_experts():
            unit = fully_shard(moe.experts[e], mesh=edp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
            unit.set_gradient_divide_factor(float(dp))
            # Sum, then divide: gloo has no PREMUL_SUM. Not on a 1-rank edp, where FSDP2 skips the
            # collective and divides in its copy, and would then divide a second time.
            unit.set_force_sum_reduction_for_comms(edp_mesh.size() > 1)


def is_expert_parameter(name: str) -> bool:
    return EXPERT_KEY.search(name) is not None
