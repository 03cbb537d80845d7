"""How big the engine's pools are: KV blocks from a byte budget (or an exact count), host swap
blocks, and for hybrid (Mamba2 + attention) models the recurrent-state slots, counted first
against the same budget: one per schedulable sequence (max_num_seqs: a sequence cannot run
without one), plus up to max_num_seqs prefix snapshots with prefix caching on (at most a quarter
of the budget); the rest becomes KV blocks for the attention layers. Swap space is split the same
way (at most half for states)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from baton.common.config import ConfigError, ModelConfig
from baton.serve.engine.config import EngineConfig
from baton.serve.runner.kv_budget import kv_budget_bytes
from baton.serve.scheduling.state_slots import StateSlots

log = logging.getLogger(__name__)


@dataclass
class Pools:
    """What the runner allocates: device KV blocks, host swap blocks, state slots (hybrids)."""

    num_blocks: int
    num_host_blocks: int
    states: StateSlots | None = None


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
