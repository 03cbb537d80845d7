"""How big the engine's pools are: KV blocks from a byte budget (or an exact count), host swap
blocks, and for hybrid (Mamba2 + attention) models the recurrent-state slots, counted first
against the same budget: one per schedulable sequence (max_num_seqs: a sequence cannot run
without one), plus up to max_num_seqs prefix snapshots with prefix caching on (at most a quarter
of the budget); the rest becomes KV blocks for the attention layers. Swap space is split the same
way (at most half for states).

A model that mixes sliding-window and full layers keeps two KV groups (serve/scheduling/window_blocks.py,
`kv_group_window` says when): the sliding layers' pool gets what max_num_seqs sequences can hold of
it at once - each its window and a partial block at both ends, plus one step's tokens - as no more
is ever used, and never more blocks than the full layers' (which then hold more tokens for the
same bytes); the full layers' pool gets the rest. Host swap space is split the same way. A sharded
model's ranks split it the same way over their own layers and heads (serve/parallel/worker.py) into
one pair of counts that fits every rank (`group_split`): both groups' block ids name the same blocks
on every rank."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from baton.common.config import ConfigError, ModelConfig
from baton.serve.engine.config import EngineConfig
from baton.serve.runner.kv_budget import kv_budget_bytes
from baton.serve.runner.model_runner import kv_block_bytes
from baton.serve.scheduling.state_slots import StateSlots

log = logging.getLogger(__name__)


@dataclass
class Pools:
    """What the runner allocates: device KV blocks, host swap blocks, state slots (hybrids)."""

    num_blocks: int
    num_host_blocks: int
    states: StateSlots | None = None
    num_window_blocks: int = 0  # KV groups: the sliding-window layers' own pool (0: none)
    num_window_host_blocks: int = 0


def plan_model_pools(config: EngineConfig, model, window: int | None) -> Pools:
    """The pools for `model` in this process; `window` (kv_group_window's): the two KV groups'."""
    mcfg, p = model.config, next(model.parameters())
    if window is None:
        block_bytes = kv_block_bytes(model, config.block_size, p.dtype, config.kv_cache_dtype)
        return plan_pools(config, mcfg, block_bytes, p.dtype, p.device)
    nsliding = sum(mcfg.is_sliding(i) for i in range(mcfg.num_hidden_layers))
    full, sliding = (
        kv_block_bytes(model, config.block_size, p.dtype, config.kv_cache_dtype, num_layers=n)
        for n in (mcfg.num_hidden_layers - nsliding, nsliding)
    )
    return plan_group_pools(config, mcfg, full, sliding, window, p.device)


def plan_pools(config: EngineConfig, mcfg: ModelConfig, block_bytes: int, dtype: torch.dtype, device) -> Pools:
    """The pools for a model in this process (a sharded model's workers size their own)."""
    if mcfg.is_hybrid:  # state slots first, from the same budget
        return plan_states(config, mcfg, block_bytes, dtype, lambda: budget_bytes(config, mcfg, device))
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        budget = budget_bytes(config, mcfg, device)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no {block_bytes}-byte block")
    swap = config.scheduler.preemption_mode == "swap"
    return Pools(int(num_blocks), config.swap_space_bytes // block_bytes if swap else 0)


def kv_group_window(config: EngineConfig, mcfg: ModelConfig) -> int | None:
    """The window, when the model's sliding-window layers get a KV group of their own: the model
    has both sliding and full attention layers, served by the plain runner, in this process or
    sharded (the workers hold both groups' tables); else
    None (a model that mixes them logs why every layer keeps every token)."""
    attn = [i for i in range(mcfg.num_hidden_layers) if mcfg.is_attention_layer(i)]
    sliding = sum(mcfg.is_sliding(i) for i in attn)
    if mcfg.sliding_window is None or not 0 < sliding < len(attn):
        return None
    spec = config.speculative
    why = next(
        (
            why
            for off, why in (
                (not config.kv_cache_groups, "kv_cache_groups is off"),
                (config.streaming, "StreamingLLM evicts the same blocks from every layer"),
                (config.early_exit_threshold is not None, "CALM early exit's runner reads one set of block tables"),
                (spec is not None and spec.method == "layerskip", "LayerSkip's draft reuses the full layers' slots"),
            )
            if off
        ),
        None,
    )
    if why is not None:
        log.info("KV groups off: the %d sliding-window layers keep every token as the full ones do (%s)", sliding, why)
        return None
    return mcfg.sliding_window


def window_demand(block_size: int, max_num_seqs: int, max_num_batched_tokens: int, window: int) -> int:
    """The most blocks the sliding layers ever use (module docstring): max_num_seqs windows, each
    with a partial block at both ends, and one step's tokens."""
    return max_num_seqs * (-(-(window - 1) // block_size) + 2) + -(-max_num_batched_tokens // block_size)


def group_split(ranks: list[tuple[int, int, int]], demand: int) -> tuple[int, int]:
    """(full blocks, sliding blocks) that fit every rank's (budget, a block's bytes over its full
    layers, over its sliding layers): the sliding pool what `demand` asks, but never more blocks
    than the full pool then has on any rank; the full pool the rest. One process is one rank; a
    pipeline stage without layers of a group has 0 bytes for it and no say in that group's count."""
    n_window = min([demand] + [budget // (full + window) for budget, full, window in ranks if full + window])
    n_full = min(((budget - n_window * window) // full for budget, full, window in ranks if full), default=0)
    return n_full, n_window


def plan_group_pools(
    config: EngineConfig, mcfg: ModelConfig, full_bytes: int, window_bytes: int, window: int, device
) -> Pools:
    """The two groups' pools (module docstring): full_bytes and window_bytes are a block's bytes
    over the full and the sliding layers; num_kv_blocks, when given, is the full layers' count."""
    bs, sched = config.block_size, config.scheduler
    demand = window_demand(bs, sched.max_num_seqs, sched.max_num_batched_tokens, window)
    if config.num_kv_blocks is not None:
        num_blocks, num_window = config.num_kv_blocks, min(config.num_kv_blocks, demand)
    else:
        budget = budget_bytes(config, mcfg, device)
        num_blocks, num_window = group_split([(budget, full_bytes, window_bytes)], demand)
        if num_window < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no {full_bytes}+{window_bytes}-byte block of the two groups"
            )
    swap = sched.preemption_mode == "swap"
    host, host_window = group_split([(config.swap_space_bytes, full_bytes, window_bytes)], demand) if swap else (0, 0)
    log.info(
        "KV groups: %d blocks of %d bytes for the full layers, %d of %d bytes for the sliding-window layers "
        "(window %d); host swap %d + %d blocks",
        num_blocks, full_bytes, num_window, window_bytes, window, host, host_window,
    )  # fmt: skip
    return Pools(int(num_blocks), int(host), None, int(num_window), int(host_window))


def budget_bytes(config: EngineConfig, mcfg: ModelConfig, device: torch.device) -> int:
    c = config
    return kv_budget_bytes(
        device,
        mcfg,
        kv_cache_bytes=c.kv_cache_bytes,
        kv_cache_fraction=c.kv_cache_fraction,
        gpu_memory_utilization=c.gpu_memory_utilization,
        max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
        max_num_seqs=c.scheduler.max_num_seqs,
        elem=torch.tensor([], dtype=mcfg.dtype).element_size(),
    )


def state_slot_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one sequence's recurrent state over all mixer layers."""
    inner = cfg.mamba_expand * cfg.hidden_size
    conv_dim = inner + 2 * cfg.mamba_n_groups * cfg.mamba_d_state
    elem = torch.tensor([], dtype=dtype).element_size()
    per_layer = conv_dim * (cfg.mamba_d_conv - 1) * elem + cfg.mamba_n_heads * cfg.mamba_d_head * cfg.mamba_d_state * 4
    mixers = sum(not cfg.is_attention_layer(i) for i in range(cfg.num_hidden_layers))
    return mixers * per_layer


@dataclass
class StateBudget:
    num_blocks: int
    num_slots: int
    num_snapshots: int
    slot_bytes: int

    @classmethod
    def split(
        cls, budget: int, block_bytes: int, slot_bytes: int, max_num_seqs: int, prefix_caching: bool
    ) -> StateBudget:
        """State slots first (one per schedulable sequence, then snapshots), the rest as KV blocks."""
        running = max_num_seqs * slot_bytes
        if budget < running + block_bytes:
            raise ConfigError(
                f"the KV cache budget of {budget} bytes cannot hold {max_num_seqs} recurrent-state slots "
                f"({slot_bytes} bytes each, one per max_num_seqs) plus one {block_bytes}-byte KV block: "
                "raise the budget or lower max_num_seqs"
            )
        snaps = min(max_num_seqs, (budget // 4) // slot_bytes) if prefix_caching else 0
        blocks = (budget - (max_num_seqs + snaps) * slot_bytes) // block_bytes
        if blocks < 1:  # the snapshots give way to the blocks
            snaps = 0
            blocks = (budget - running) // block_bytes
        return cls(int(blocks), max_num_seqs, int(snaps), slot_bytes)


def plan_states(
    config: EngineConfig, mcfg: ModelConfig, block_bytes: int, dtype: torch.dtype, budget: Callable[[], int]
) -> Pools:
    """(KV blocks, host KV blocks, the slots) for a hybrid: the budget split as the module
    docstring says; with num_kv_blocks given the slots come on top of the blocks."""
    seqs, prefix, slot = config.scheduler.max_num_seqs, config.enable_prefix_caching, state_slot_bytes(mcfg, dtype)
    if config.num_kv_blocks is not None:
        split = StateBudget(config.num_kv_blocks, seqs, min(seqs, config.num_kv_blocks) if prefix else 0, slot)
    else:
        split = StateBudget.split(budget(), block_bytes, slot, seqs, prefix)
    host_slots = num_host = 0
    if config.scheduler.preemption_mode == "swap":
        host_slots = min(seqs, config.swap_space_bytes // 2 // slot)
        num_host = (config.swap_space_bytes - host_slots * slot) // block_bytes
    log.info(
        "hybrid: %d recurrent-state slots + %d prefix snapshots of %d bytes, %d KV blocks of %d bytes",
        split.num_slots, split.num_snapshots, slot, split.num_blocks, block_bytes,
    )  # fmt: skip
    return Pools(split.num_blocks, num_host, StateSlots(split.num_slots, split.num_snapshots, host_slots))
