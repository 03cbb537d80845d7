"""A sequence being generated: its tokens, how many are in the KV cache, and its block table(s)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from baton.serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.serve.core.structured import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted; its KV blocks live in the host pool
    FINISHED = "finished"


@dataclass
class SequenceMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples this is
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first (vLLM's convention)
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, float]] = field(default_factory=list)
    output_text: str = ""
    generator: torch.Generator | None = None
    metrics: SequenceMetrics | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full token blocks
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    host_block_table: list[int] = field(default_factory=list)  # where its KV lives while SWAPPED
    # StreamingLLM / sliding window: leading blocks dropped from the cache
    num_evicted_tokens: int = 0
    # KV groups (a model mixing sliding-window and full layers: serve/scheduling/window_blocks.py): the
    # sliding layers' own table over the same logical blocks as block_table (which is then the full
    # layers'), its first num_window_dropped entries NULL (out of the window, freed); None: no such group
    window_block_table: list[int] | None = None
    num_window_dropped: int = 0
    window_host_block_table: list[int] = field(default_factory=list)  # while SWAPPED (-1: a NULL entry)
    # Speculative decoding: this step's proposed tokens (a chain, or a tree via spec_parents) and,
    # for a draft model that sampled them, the draft's distributions [k, vocab] (None: deterministic)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_parents: list[int] | None = None  # tree: parent index of each proposal (-1 = the last real token)
    spec_draft_probs: torch.Tensor | None = None
    grammar: "SequenceGrammar | None" = None  # thinking, then structured outputs (serve/core/structured.py)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.metrics is None:
            self.metrics = SequenceMetrics(arrival_time=self.arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def make_generator(self) -> None:
        """Sample i of a seeded request draws from seed + i. Reduced mod 2**64, the range
        manual_seed takes: any int64 seed works, and seed + i cannot overflow it."""
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed((self.params.seed + self.index) % 2**64)
