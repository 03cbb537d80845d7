"""What training can and cannot do with a hybrid: Bamba (Mamba2 mixers + attention layers) and the
Gated DeltaNet families - Qwen3.5 (`qwen3_5_text`), Qwen3.5-MoE (`qwen3_5_moe_text`), Qwen3-Next
(`qwen3_next`): DeltaNet mixers + gated attention, with routed experts and a gated shared expert.

A hybrid trains like any other model wherever a backend treats a decoder layer as a black box:
plain PyTorch and DDP, DeepSpeed ZeRO 0-3 (offload included), torch3d's FSDP2/DDP over dp and its
pipeline stages (whole layers per stage), expert parallelism over the routed experts (the shared
expert and its gate stay data-parallel, as dense parameters), full and selective recomputation
(selective: the attention layers' core, or every RMSNorm and SwiGLU activation), compile (one
graph per layer kind), init_from a transformers checkpoint (sharded loads included: a mixer's
parameters are plain tensors to FSDP2's and ZeRO-3's slicing). The mixers' forward and backward
run PyTorch chunked forms - kernels/ssd_scan.py's scan, kernels/gated_delta.py's WY form - since
their Triton kernels are forward-only (serving), so `attention: triton` changes only the attention
layers; the rule keeps its state and decays in float32 under bf16.

What needs the mixer itself cut across ranks, or a layer Baton's other code paths do not have, is
refused here before any work starts (the recipe checks, baton.train.validate), naming the mixer
and, per backend and layout, why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.train.config import TrainConfig


@dataclass(frozen=True)
class MixerFacts:
    """Why a backend or layout cannot hold one kind of mixer (the refusals' wording)."""

    name: str
    megatron: str  # what Baton's megatron-core model lacks
    tensor_parallel: str  # which projections the tensor-parallel plan would have to split, and how
    state: str  # what the recurrence carries across the sequence (context parallelism would cut it)


MIXERS = {
    "mamba2": MixerFacts(
        "Mamba2",
        "megatron-core's GPTModel, which has no Mamba2 layers",
        "its in_proj packs z, x, B, C and dt in one matrix (five column ranges per rank) and its depthwise "
        "conv and gated norm run over the whole inner width",
        "a mixer's scan carries its state from the first token to the last",
    ),
    "gated_deltanet": MixerFacts(
        "Gated DeltaNet",
        "megatron-core's GPTModel from the standard layer spec, which has no Gated DeltaNet layers (megatron-core "
        "0.16's experimental one needs fla's and causal_conv1d's CUDA kernels, and Baton's weight mapping has "
        "no place for in_proj_qkv, conv1d, A_log or dt_bias) and no attention output gate",
        "its in_proj_qkv stacks q, k and v (three column ranges per rank; Qwen3-Next's in_proj_qkvz and "
        "in_proj_ba interleave them per key head), its depthwise conv1d and the rule's heads would have to split "
        "with them, in_proj_z, in_proj_b and in_proj_a by value head and out_proj by rows; the plan shards "
        "attention and MLPs only",
        "the gated delta rule carries each head's state (and the conv its last inputs) from the first token "
        "to the last",
    ),
}


def check_recipe(need, cfg: TrainConfig, hybrid: bool) -> None:
    """Refuse what a hybrid cannot train with; `hybrid`: the recipe's model is one."""
    if not hybrid:
        return
    model = cfg.model_config(vocab_size=cfg.model.get("vocab_size", 1024))
    mixer = MIXERS[model.mixer]
    why = f"model_type {model.model_type} ({mixer.name} mixer layers)"
    p = cfg.parallel
    need(
        cfg.backend != "megatron",
        f"backend megatron cannot train {why}: Baton's megatron backend builds {mixer.megatron}; use backend "
        "torch, deepspeed or torch3d",
    )
    need(
        p.tp == 1,
        f"parallel.tp {p.tp} with {why}: the mixer does not shard with the tensor-parallel plan - "
        f"{mixer.tensor_parallel}; use parallel.tp 1 (dp, pp"
        + (" and ep" if model.num_local_experts else "")
        + " work)",
    )
    need(
        p.cp == 1,
        f"parallel.cp {p.cp} with {why}: context parallelism splits each sequence over ranks for ring "
        f"attention, but {mixer.state} (every rank but the first would start from a zero state); use "
        "parallel.cp 1",
    )
    need(
        not cfg.early_exit.enabled,
        f"early_exit with {why}: the exits could not be served - the layerskip draft keeps no state slots "
        "for the mixers and CALM early exit has no K/V to fill in them; remove the early_exit section",
    )
