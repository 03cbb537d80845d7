"""EngineConfig: every engine option, each a `baton serve` flag. validate() checks each field on its
own; what combines with what is serve/engine/rules.py's, checked once before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.serve.parallel.config import ParallelConfig
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative.config import SpeculativeConfig


@dataclass
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # exact pool size; else sized from the budget below
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float = 0.1  # of available RAM (CPU)
    gpu_memory_utilization: float = 0.9  # CUDA: of the device's memory, for weights + activations + KV (vLLM's)
    swap_space_bytes: int = 64 * 1024**2  # host pool for swap preemption
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # a model mixing sliding-window and full layers: the sliding ones keep only their window's blocks
    # (serve/scheduling/window_blocks.py); False: every layer keeps every token, one block table
    kv_cache_groups: bool = True
    streaming_sink_tokens: int | None = None  # set both streaming_* to enable StreamingLLM
    streaming_window_tokens: int | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    kv_cache_dtype: str = "auto"  # "int8" / "fp8": quantized KV pools (serve/quantization/kv_cache.py)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # tensor/pipeline parallel (serve/parallel/)
    early_exit_threshold: float | None = (
        None  # CALM: leave at the first recorded exit this confident (serve/runner/early_exit.py)
    )

    @property
    def streaming(self) -> bool:
        return self.streaming_window_tokens is not None

    def validate(self) -> None:
        """Every field is a `baton serve` flag: a value that cannot work fails here, before a port binds."""
        positive = {
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_cache_bytes": self.kv_cache_bytes,
            "max_model_len": self.max_model_len,
            "streaming_window_tokens": self.streaming_window_tokens,
        }
        for name, value in positive.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("kv_cache_fraction", "gpu_memory_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.swap_space_bytes < 0 or (self.streaming_sink_tokens or 0) < 0:
            raise ValueError("swap_space_bytes and streaming_sink_tokens must be >= 0")
        if self.streaming_sink_tokens is not None and self.streaming_window_tokens is None:
            raise ValueError("streaming_sink_tokens needs streaming_window_tokens (StreamingLLM is on with a window)")
        self.scheduler.validate()
        self.parallel.validate()
        if self.speculative is not None:
            self.speculative.validate()
        if self.early_exit_threshold is not None and not 0 < self.early_exit_threshold <= 1:
            raise ValueError(f"early_exit_threshold must be in (0, 1], got {self.early_exit_threshold}")
