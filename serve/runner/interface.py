"""Runner: what the engine asks of whatever runs its batches.

The in-process ModelRunner (serve/runner/model_runner.py) and the driver of a model sharded over
worker processes (serve/parallel/driver.py's DistributedRunner) both implement it, and wrappers
installed from outside keep it (CALM early exit, serve/runner/early_exit.py). The engine calls
only these members and never asks which runner it holds: a capability is a member's value (e.g.
max_in_flight), not a type check.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from baton.common.config import ModelConfig
from baton.serve.core.sequence import Sequence
from baton.serve.runner.model_runner import ExecuteResult
from baton.serve.scheduling.block_manager import BlockOps


@runtime_checkable
class Runner(Protocol):
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    block_size: int
    num_blocks: int  # device KV blocks the runner allocated
    num_host_blocks: int  # host blocks for swap preemption
    max_in_flight: int  # batches the runner overlaps (pipeline stages); 1: one step at a time

    def apply_block_ops(self, ops: BlockOps) -> None:
        """The scheduler's copies, swaps and state ops for the coming step, in order."""

    def execute(
        self,
        scheduled: list[tuple[Sequence, int]],
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
    ) -> ExecuteResult:
        """Run one scheduled batch: logits per sampled row (hidden states with return_hidden)."""

    def submit(
        self,
        scheduled: list[tuple[Sequence, int]],
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
    ) -> Any:
        """Start a batch without waiting for it (a handle for collect); up to max_in_flight at once."""

    def collect(self, handle: Any) -> ExecuteResult:
        """The result of a submitted batch, oldest first."""

    def keep_state(self, seq_id: int, num_accepted: int) -> None:
        """Hybrids: after verification, keep the recurrent state at the last accepted token."""

    def move_slots(
        self, src: list[int], dst: list[int], window_src: list[int] | None = None, window_dst: list[int] | None = None
    ) -> None:
        """Copy K/V between cache slots (an accepted tree path compacted into a chain); with KV groups
        the sliding-window layers' slots are window_src/window_dst."""

    def release(self, seq_id: int) -> None:
        """A sequence left the engine: forget what the runner keeps for it."""

    def check_health(self) -> None:
        """Raise EngineFault when the model can no longer run (a worker process is gone)."""

    def shutdown(self) -> None:
        """Stop what the runner started (worker processes); nothing runs after it."""
