"""Tensor (Megatron) and sequence parallelism, applied to a model chunk with DTensor plans.

Attention: q/k/v column-wise (each rank keeps whole heads, GQA key/value heads split the same
way, so a rank's query heads find their key/value heads locally), o row-wise. MLP: gate/up
column-wise, down row-wise; an MoE block is not split (TP covers the dense parts): it runs on the
gathered sequence, replicated over tp (with parallel.ep its experts are dealt out over dp).
Embedding row-wise over the vocabulary (vocab-parallel: each rank looks
up its vocabulary slice, the partial results are summed) and the LM head column-wise over the
vocabulary; with loss_parallel the logits stay sharded and cross-entropy reduces across ranks
without ever gathering [tokens, vocab].

Sequence parallelism (Korthikanti et al. 2022): between the tensor-parallel regions the residual
stream and the norms are sharded along the sequence; entering attention/MLP all-gathers the
sequence, leaving them reduce-scatters it (instead of all-reducing), so norm activations and the
residual stream are 1/tp per rank at the same communication volume.
"""

from __future__ import annotations

from baton.train.parallel.pipeline import ModelChunk
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


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
        if hasattr(layer, "mlp"):
            plan["mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan["mlp.gate_proj"] = ColwiseParallel()
            plan["mlp.up_proj"] = ColwiseParallel()
            plan["mlp.down_proj"] = RowwiseParallel(output_layouts=seq)
        else:  # MoE: replicated over tp, on every token of the (gathered) sequence; see expert_parallel.py
            plan["block_sparse_moe"] = PrepareModuleInputOutput(
                input_layouts=(seq,),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(seq,),
            )
        if norm is not None:
            plan["input_layernorm"] = plan["post_attention_layernorm"] = norm
        parallelize_module(layer, tp_mesh, plan)
        attn = layer.self_attn
        attn.num_heads, attn.num_kv_heads = attn.num_heads // tp, attn.num_kv_heads // tp
    if chunk.has_embedding and chunk.has_head and chunk.tied:
        chunk.lm_head.weight = chunk.model.embed_tokens.weight  # both Shard(0) over the vocabulary: re-tie
