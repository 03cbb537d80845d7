"""The parallel layout (dp x pp x cp x tp; ep inside dp for MoE experts) and the check that
rejects impossible ones.

Everything here is arithmetic on the config and the world size, so a bad layout fails with a
clear message before any process group, mesh or weight exists. `ParallelConfig` is the recipe's
`parallel` section, the layout of both backend torch3d and backend megatron (which checks it its
own way: baton.train.backends.megatron.check_recipe); `check_layout` is torch3d's check.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.common.config import ConfigError, ModelConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
DP_MODES = ("fsdp", "ddp")


@dataclass
class ParallelConfig:
    dp: int = -1  # data-parallel degree; -1: the world size over tp x pp x cp
    tp: int = 1  # tensor parallel: heads, MLP width and vocabulary split across ranks
    pp: int = 1  # pipeline parallel: layers split into stages
    cp: int = 1  # context parallel: the sequence split across ranks (ring attention)
    sequence_parallel: bool = True  # with tp > 1: norms/residuals sharded along the sequence (Megatron SP)
    loss_parallel: bool = True  # with tp > 1: cross-entropy on vocab shards, never gathering the logits
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    pp_stages_per_rank: int = 1  # virtual stages per pipeline rank (interleaved_1f1b needs >= 2)
    dp_mode: str = "fsdp"  # fsdp (FSDP2 fully_shard over dp x cp) | ddp (replicated, tp == 1 only)
    ep: int = 1  # expert parallel (MoE): experts dealt out over ep of the dp ranks (expert_parallel.py)


@dataclass(frozen=True)
class Layout3D:
    """A checked layout with every degree resolved."""

    dp: int
    pp: int
    cp: int
    tp: int
    sequence_parallel: bool
    loss_parallel: bool
    pp_schedule: str
    stages_per_rank: int
    dp_mode: str
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def describe(self) -> str:
        parts = [
            f"dp={self.dp}" + (f"({self.dp_mode})" if self.dp * self.cp > 1 else ""),
            f"pp={self.pp}",
            f"cp={self.cp}",
            f"tp={self.tp}",
        ]
        if self.tp > 1 and self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(f"{self.pp_schedule}x{self.stages_per_rank}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        return " ".join(parts)


def check_layout(par: ParallelConfig, model: ModelConfig, world_size: int, microbatches: int, seq_len: int) -> Layout3D:
    """Resolve `par` for `world_size`, or raise ConfigError naming the first impossibility.

    `microbatches`: micro-batches each data-parallel rank runs per optimizer step (the pipeline's
    micro-batches); `seq_len`: tokens per training sample."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(f"invalid parallel layout: {msg}")

    for name in ("tp", "pp", "cp", "pp_stages_per_rank", "ep"):
        v = getattr(par, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name} must be a positive integer, got {v!r}")
    need(
        isinstance(par.dp, int) and (par.dp >= 1 or par.dp == -1),
        f"dp must be a positive integer or -1, got {par.dp!r}",
    )
    need(par.pp_schedule in SCHEDULES, f"pp_schedule must be one of {SCHEDULES}, got {par.pp_schedule!r}")
    need(par.dp_mode in DP_MODES, f"dp_mode must be one of {DP_MODES}, got {par.dp_mode!r}")
    inner = par.tp * par.pp * par.cp
    need(
        world_size % inner == 0,
        f"world size {world_size} is not divisible by tp x pp x cp = {par.tp} x {par.pp} x {par.cp} = {inner}",
    )
    dp = world_size // inner if par.dp == -1 else par.dp
    need(
        dp * inner == world_size,
        f"dp x tp x pp x cp = {dp} x {par.tp} x {par.pp} x {par.cp} = {dp * inner} != world size {world_size}",
    )

    tp = par.tp
    if tp > 1:
        need(
            model.num_attention_heads % tp == 0,
            f"num_attention_heads {model.num_attention_heads} is not divisible by tp={tp}",
        )
        need(
            model.num_key_value_heads % tp == 0,
            f"num_key_value_heads {model.num_key_value_heads} is not divisible by tp={tp} (GQA key/value heads "
            "are split across tensor-parallel ranks, not replicated)",
        )
        dense = any(not model.is_moe_layer(i) for i in range(model.num_hidden_layers))  # (experts are not split)
        need(
            not dense or model.intermediate_size % tp == 0,
            f"intermediate_size {model.intermediate_size} is not divisible by tp={tp}",
        )
        need(
            not par.sequence_parallel or seq_len % (tp * par.cp) == 0,
            f"sequence parallelism needs seq_len {seq_len} divisible by tp x cp = {tp * par.cp}",
        )
        need(
            par.dp_mode == "fsdp" or dp * par.cp == 1,
            "dp_mode ddp cannot wrap tensor-parallel (DTensor) parameters: use dp_mode fsdp",
        )

    stages = par.pp * par.pp_stages_per_rank
    need(
        stages <= model.num_hidden_layers,
        f"{stages} pipeline stages (pp={par.pp} x pp_stages_per_rank={par.pp_stages_per_rank}) but only "
        f"{model.num_hidden_layers} layers: every stage needs at least one layer",
    )
    check_stages_per_rank(need, par)
    if par.pp > 1:
        need(
            not model.tie_word_embeddings,
            "tie_word_embeddings with pp > 1: the embedding and the LM head live on different pipeline stages",
        )
        if par.pp_schedule != "gpipe":
            need(
                microbatches >= par.pp,
                f"{par.pp_schedule} needs at least as many micro-batches per step as "
                f"pipeline ranks: {microbatches} micro-batches < pp={par.pp} (raise global_batch_size or "
                "grad_accum_steps, or use gpipe)",
            )
        if par.pp_schedule == "interleaved_1f1b":
            rounds = max(1, microbatches // par.pp)
            need(
                microbatches % rounds == 0,
                f"interleaved_1f1b needs the micro-batches ({microbatches}) to be a "
                f"multiple of {rounds} (micro-batches // pp)",
            )

    if par.ep > 1:
        _check_ep(need, par, model, dp)
    if par.cp > 1:
        need(
            seq_len % (2 * par.cp) == 0,
            f"context parallelism needs seq_len {seq_len} divisible by 2 x cp = "
            f"{2 * par.cp} (zigzag load balancing gives each rank two chunks)",
        )
        need(model.sliding_window is None, "context parallelism with sliding-window attention is not supported")
        need(
            not model.attention_sinks and not model.attn_logit_softcapping,
            "context parallelism (ring attention) has no attention sinks (gpt-oss) or soft-capped scores (Gemma 2)",
        )
    return Layout3D(
        dp,
        par.pp,
        par.cp,
        tp,
        par.sequence_parallel and tp > 1,
        par.loss_parallel and tp > 1,
        par.pp_schedule,
        par.pp_stages_per_rank,
        par.dp_mode,
        par.ep,
    )


def check_stages_per_rank(need, par: ParallelConfig) -> None:
    """Interleaved 1F1B and only it runs several stages per rank (megatron's vp): both backends."""
    if par.pp_schedule == "interleaved_1f1b":
        need(par.pp_stages_per_rank >= 2, "pp_schedule interleaved_1f1b needs pp_stages_per_rank >= 2")
    else:
        need(
            par.pp_stages_per_rank == 1,
            f"pp_schedule {par.pp_schedule} runs one stage per rank: set pp_stages_per_rank=1, or use interleaved_1f1b",
        )


def _check_ep(need, par: ParallelConfig, model: ModelConfig, dp: int) -> None:
    """Experts are dealt out whole over an ep sub-group of the data-parallel ranks."""
    experts = model.num_local_experts
    need(experts > 0, f"ep={par.ep} needs an MoE model (num_local_experts > 0)")
    need(experts % par.ep == 0, f"ep={par.ep} does not divide the {experts} experts (num_local_experts)")
    need(
        dp % par.ep == 0,
        f"ep={par.ep} does not divide the data-parallel degree dp={dp} (experts are sharded over ep of the dp ranks)",
    )
    need(
        par.dp_mode == "fsdp",
        "ep > 1 needs dp_mode fsdp (the experts are FSDP2 units over their expert-data-parallel group)",
    )
    need(par.cp == 1, "ep > 1 with context parallelism is not supported (use cp=1)")
    need(
        model.model_type != "gpt_oss",
        "ep > 1 with gpt-oss: its experts are stacked tensors ([E, H, 2I]), not one module per expert to deal "
        "out; use ep=1 (they are FSDP-sharded with their layer, and replicated over tp)",
    )


def data_parallel_size(par: ParallelConfig, world_size: int) -> int:
    """How many model replicas share each global batch (check_layout verifies it fits)."""
    return max(1, world_size // (par.tp * par.pp * par.cp)) if par.dp == -1 else par.dp


def data_parallel_rank(par: ParallelConfig, rank: int, world_size: int) -> int:
    """Which replica a global rank belongs to, i.e. which share of each global batch it trains
    on: the mesh is row-major over (pp, dp, cp, tp), so tp and cp ranks of a replica are adjacent."""
    return (rank // (par.tp * par.cp)) % data_parallel_size(par, world_size)
