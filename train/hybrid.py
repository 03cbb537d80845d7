"""What training can and cannot do with a hybrid (Bamba: Mamba2 mixers + attention layers).

A hybrid trains like any other model wherever a backend treats a decoder layer as a black box:
plain PyTorch and DDP, DeepSpeed ZeRO 0-3 (offload included), torch3d's FSDP2/DDP over dp and its
pipeline stages (whole layers per stage), full and selective recomputation (selective: the
attention layers' core, or every RMSNorm and SwiGLU activation), compile (one graph per layer
kind). The mixer's forward and backward run the PyTorch chunked scan (kernels/ssd_scan.py's
torch path: the Triton kernel is forward-only), so `attention: triton` changes only the
attention layers.

What needs the mixer itself cut across ranks, or a layer Baton's other code paths do not have, is
refused here before any work starts (the recipe checks, baton.train.validate), with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.train.config import TrainConfig


def check_recipe(need, cfg: TrainConfig, hybrid: bool) -> None:
    """Refuse what a hybrid cannot train with; `hybrid`: the recipe's model is one."""
    if not hybrid:
        return
    p = cfg.parallel
    why = "model_type bamba (Mamba2 mixer layers)"
    need(
        cfg.backend != "megatron",
        f"backend megatron cannot train {why}: Baton's megatron backend builds megatron-core's GPTModel, "
        "which has no Mamba2 layers; use backend torch, deepspeed or torch3d",
    )
    need(
        p.tp == 1,
        f"parallel.tp {p.tp} with {why}: the mixer does not shard with the tensor-parallel plan - its in_proj "
        "packs z, x, B, C and dt in one matrix (five column ranges per rank) and its depthwise conv and gated "
        "norm run over the whole inner width; use parallel.tp 1 (dp and pp work)",
    )
    need(
        p.cp == 1,
        f"parallel.cp {p.cp} with {why}: context parallelism splits each sequence over ranks for ring "
        "attention, but a mixer's scan carries its state from the first token to the last (every rank but "
        "the first would start from a zero state); use parallel.cp 1",
    )
    need(
        not cfg.early_exit.enabled,
        f"early_exit with {why}: the exits could not be served - the layerskip draft keeps no state slots "
        "for the mixers and CALM early exit has no K/V to fill in them; remove the early_exit section",
    )
