"""ParallelConfig: how a served model is split over processes, checked before any process starts."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from baton.common.config import ModelConfig

log = logging.getLogger(__name__)

MOE_MODES = ("auto", "tensor", "expert")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks that split every layer (heads, MLP columns, vocabulary)
    pipeline_parallel_size: int = 1  # ranks that each hold a contiguous slice of the layers
    # Routed experts: "tensor" (every expert split) or "expert" (whole experts per rank); "auto" is
    # expert when the ranks divide the experts: measured 5-15% faster per MoE layer at T=2 on CPU
    # (half as many, twice as wide GEMMs; docs/benchmarks.md), else tensor.
    moe_parallel: str = "auto"
    distributed_timeout_s: float = 300.0  # a worker silent this long (in a collective) is declared dead
    heartbeat_s: float = 1.0  # an idle driver pings its workers this often, so a dead one is noticed
    shared_memory: bool = True  # tensor-parallel collectives through /dev/shm when a group shares one CPU host

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self) -> None:
        """What needs no model: sizes and modes."""
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.moe_parallel not in MOE_MODES:
            raise ValueError(f"moe_parallel must be one of {MOE_MODES}, got {self.moe_parallel!r}")
        if not self.distributed_timeout_s > 0 or not self.heartbeat_s > 0:
            raise ValueError("distributed_timeout_s and heartbeat_s must be > 0")

    def moe_mode(self, cfg: ModelConfig) -> str:
        """The MoE split this layout uses for `cfg` ("auto" resolved)."""
        if self.moe_parallel != "auto":
            return self.moe_parallel
        return (
            "expert" if cfg.num_local_experts and cfg.num_local_experts % self.tensor_parallel_size == 0 else "tensor"
        )

    def check_model(self, cfg: ModelConfig, group_size: int | None = None) -> None:
        """Refuse a layout the model cannot be split into, naming the number that does not divide."""
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if heads % t:
            raise ValueError(f"tensor_parallel_size {t} does not divide the model's {heads} attention heads")
        if kv % t and t % kv:
            raise ValueError(
                f"tensor_parallel_size {t} and the model's {kv} key/value heads: one must divide the other "
                "(KV heads are split, or replicated when there are fewer than ranks)"
            )
        experts = cfg.num_local_experts
        mode = self.moe_mode(cfg)
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        dense = len(moe_layers) < cfg.num_hidden_layers  # (Qwen3-MoE may keep dense MLPs in some layers)
        split_experts = bool(moe_layers) and mode == "tensor"
        if moe_layers and mode == "expert" and experts % t:
            raise ValueError(f"expert parallelism: tensor_parallel_size {t} does not divide {experts} experts")
        if dense and cfg.intermediate_size % t:
            raise ValueError(f"tensor_parallel_size {t} does not divide intermediate_size {cfg.intermediate_size}")
        if split_experts and cfg.expert_intermediate_size % t:
            raise ValueError(
                f"tensor_parallel_size {t} does not divide the experts' intermediate size "
                f"{cfg.expert_intermediate_size} (or use moe_parallel='expert' when it divides the {experts} experts)"
            )
        shared = (cfg.expert_intermediate_size * (cfg.n_shared_experts or 0)) if moe_layers else 0
        if shared % t:  # (DeepSeek-V3's shared experts are cut like a dense MLP in both MoE modes)
            raise ValueError(f"tensor_parallel_size {t} does not divide the shared experts' width {shared}")
        if p > cfg.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size {p} is more than the model's {cfg.num_hidden_layers} layers")
        if group_size and t > 1:  # a row-parallel shard must hold whole int4 quantization groups
            # (an MLA layer's o_proj reads v_head_dim per head; head_dim is its rope width)
            widths = [("attention output", heads * (cfg.v_head_dim if cfg.is_mla else cfg.head_dim))]
            if dense:
                widths.append(("MLP", cfg.intermediate_size))
            # Whole experts per rank are not split; gpt-oss's stacked experts stay in float (quantize.py).
            if split_experts and cfg.model_type != "gpt_oss":
                widths.append(("expert MLP", cfg.expert_intermediate_size))
            for name, width in widths:
                if (width // t) % group_size:
                    raise ValueError(
                        f"the {name} input ({width}) split {t} ways is {width // t} columns, not whole int4 "
                        f"quantization groups of {group_size}: use another tensor_parallel_size, or quantize "
                        f"with a group size that divides {width // t}"
                    )

    def check_devices(self, device: str, nnodes: int = 1) -> None:
        """More ranks than devices on a CUDA host is refused; on CPU it is allowed (ranks share cores)."""
        per_node = -(-self.world_size // nnodes)
        if torch.device(device).type == "cuda":
            have = torch.cuda.device_count()
            if per_node > have:
                raise ValueError(f"{per_node} ranks on this node but only {have} CUDA devices")
        elif per_node > (os.cpu_count() or 1):
            log.warning("%d ranks on %d CPU cores: ranks will share cores", per_node, os.cpu_count())


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The contiguous layers pipeline stage `stage` holds (as even as the count allows)."""
    return range(stage * num_layers // stages, (stage + 1) * num_layers // stages)
