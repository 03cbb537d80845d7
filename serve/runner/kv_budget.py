"""How many bytes the paged KV pool may take on a device (each rank sizes its own; the smallest wins).

Explicit sizes win (num_kv_blocks, then kv_cache_bytes). Otherwise on CUDA, vLLM's rule: this
process may use gpu_memory_utilization of the device's total memory; the pool gets what is left of
that after the weights already loaded (torch.cuda.memory_allocated) and a reserve for one step's
activations at the scheduler's token budget, and never more than is free now (other processes).
On CPU the pool takes kv_cache_fraction of the available RAM, shared by the ranks on the host.
"""

from __future__ import annotations

import psutil
import torch
from baton.common.config import ModelConfig


def activation_reserve(cfg: ModelConfig, max_tokens: int, max_seqs: int, elem: int, tp: int = 1) -> int:
    """A step's activation peak, estimated: the residual stream, q/k/v (MLA: q, the latent and the
    absorbed query and output) and the MLP's two halves per token (one layer is live at a time),
    attention outputs, and fp32 logits of the sampled rows; doubled for the allocator's slack."""
    if cfg.is_mla:  # q and the attention output per head, and the absorbed q_lat / o_lat (kv_lora_rank each)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        per_head = qk + cfg.v_head_dim + 2 * cfg.kv_lora_rank
        attention = cfg.num_attention_heads * per_head // tp + cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        attention = 3 * cfg.num_attention_heads * cfg.head_dim // tp
    per_token = 4 * cfg.hidden_size + 2 * (cfg.intermediate_size // tp) + attention
    return 2 * (max_tokens * per_token * elem + max_seqs * cfg.vocab_size * 4)


def kv_budget_bytes(
    device: torch.device,
    cfg: ModelConfig,
    *,
    kv_cache_bytes: int | None,
    kv_cache_fraction: float,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    elem: int,
    tp: int = 1,
    ranks_on_host: int = 1,
) -> int:
    """The pool's bytes on `device` for a model of `cfg` in `elem`-byte activations, split `tp` ways."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = activation_reserve(cfg, max_num_batched_tokens, max_num_seqs, elem, tp)
        allowed = int(total * gpu_memory_utilization) - torch.cuda.memory_allocated(device) - reserve
        return max(0, min(allowed, free - reserve))
    return int(psutil.virtual_memory().available * kv_cache_fraction / ranks_on_host)
