"""Tensor (Megatron) and sequence parallelism, applied to a model chunk with DTensor plans.

Attention: q/k/v column-wise (each rank keeps whole heads, GQA key/value heads split the same
way, so a rank's query heads find their key/value heads locally), o row-wise. MLP: gate/up
column-wise, down row-wise; an MoE block (Mixtral's, Qwen3-MoE's, gpt-oss's) is not split (TP
covers the dense parts): it runs on the gathered sequence, replicated over tp (with parallel.ep its
experts are dealt out over dp).
Embedding row-wise over the vocabulary (vocab-parallel: each rank looks
up its vocabulary slice, the partial results are summed) and the LM head column-wise over the
vocabulary; with loss_parallel the logits stay sharded and cross-entropy reduces across ranks
without ever gathering [tokens, vocab].

The newer families' attention pieces follow the heads: a q/k norm per head (Qwen3, Gemma 3) is
replicated and sees the rank's heads as a Shard(head) DTensor, so its weight gradient sums over
every rank's heads; OLMo 2's norm over the whole q/k projection keeps the rank's slice of its
weight (Shard(0)) and sees the rank's columns as a Shard(-1) DTensor, so its mean of squares is
DTensor's reduction over the full width (an all-reduce, in the backward too); gpt-oss's sinks are
sharded by head (Shard(0)) and the attention core reads the rank's heads' (to_local, which carries
their gradient back).

Sequence parallelism (Korthikanti et al. 2022): between the tensor-parallel regions the residual
stream and the norms are sharded along the sequence; entering attention/MLP all-gathers the
sequence, leaving them reduce-scatters it (instead of all-reducing), so norm activations and the
residual stream are 1/tp per rank at the same communication volume. Every norm of the layout is
sequence-parallel (Gemma's sandwich norms, OLMo 2's post-norms); a norm on a block's output hands
back its local shard, which is added to the residual stream.
"""

from __future__ import annotations

import torch
from baton.common.model import Attention
from baton.common.moe import MoE
from baton.train.parallel.pipeline import ModelChunk
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class WidthShardedNorm(ParallelStyle):
    """A norm over the whole (column-parallel) projection: weight Shard(0), input the rank's columns
    as Shard(-1), output the local columns again."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for n, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(n, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))

        def inputs(mod: nn.Module, args, mesh: DeviceMesh):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False)
            return (x, *args[1:])

        return distribute_module(module, device_mesh, partition, inputs, lambda mod, out, mesh: out.to_local())


class ShardedSinksAttention(Attention):
    """Attention whose `sinks` parameter is a Shard(0) DTensor over the heads: the attention core
    reads this rank's heads' sinks as a plain tensor."""

    @property
    def sinks(self) -> torch.Tensor | None:
        p = self._parameters["sinks"]
        return p.to_local() if isinstance(p, DTensor) else p


def apply_tp(chunk: ModelChunk, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard `chunk` in place over `tp_mesh`; attention modules then see their local head counts."""
    tp = tp_mesh.size()
    seq = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream between regions
    norm = SequenceParallel() if sequence_parallel else None  # None: plain module, replicated input
    top: dict[str, object] = {}
    if chunk.has_embedding:
        top["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if chunk.has_head:
        if norm is not None:
            top["model.norm"] = norm
        top["lm_head"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(chunk, tp_mesh, top)
    for layer in chunk.model.layers.values():
        attn = layer.self_attn
        plan = {
            # Attention.forward(x, cos, sin, attn): only x is distributed.
            "self_attn": PrepareModuleInput(
                input_layouts=(seq, None, None, None), desired_input_layouts=(Replicate(), None, None, None)
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
        }
        if attn.qk_norm == "head":  # on [B, S, heads, D]: the rank's heads
            plan["self_attn.q_norm"] = plan["self_attn.k_norm"] = SequenceParallel(
                sequence_dim=2, use_local_output=True
            )
        elif attn.qk_norm == "full":  # on [B, S, heads * D]: the rank's columns
            plan["self_attn.q_norm"] = plan["self_attn.k_norm"] = WidthShardedNorm()
        if isinstance(layer.ffn, MoE):  # replicated over tp, on every token of the (gathered) sequence
            plan[layer.ffn_name] = PrepareModuleInputOutput(
                input_layouts=(seq,),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(seq,),
            )
        else:
            name = layer.ffn_name
            plan[name] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan[f"{name}.gate_proj"] = ColwiseParallel()
            plan[f"{name}.up_proj"] = ColwiseParallel()
            plan[f"{name}.down_proj"] = RowwiseParallel(output_layouts=seq)
        if norm is not None:
            for n in LAYER_NORMS:
                if hasattr(layer, n):
                    # A norm of a block's output ("sandwich", "post") is added to the residual: local out.
                    on_output = n == "post_feedforward_layernorm" or (
                        n == "post_attention_layernorm" and layer.norm_layout != "pre"
                    )
                    plan[n] = SequenceParallel(use_local_output=True) if on_output else norm
        parallelize_module(layer, tp_mesh, plan)
        if attn.sinks is not None:
            attn.sinks = nn.Parameter(distribute_tensor(attn.sinks.data, tp_mesh, [Shard(0)]))
            attn.__class__ = ShardedSinksAttention
        attn.num_heads, attn.num_kv_heads = attn.num_heads // tp, attn.num_kv_heads // tp
    if chunk.has_embedding and chunk.has_head and chunk.tied:
        chunk.lm_head.weight = chunk.model.embed_tokens.weight  # both Shard(0) over the vocabulary: re-tie
