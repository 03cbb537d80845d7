"""Tensor-parallel training steps of the 2025-26 families (run by torchrun, world 2: tp=2).

Usage: families_tp_run.py OUT. For every family in FAMILIES, with and without sequence parallelism, one
step of Parallel3D on a fixed batch from the same initial weights; rank 0 writes OUT/<family>-<sp|nosp>.pt
with the loss, the whole gradients and the clipped-with global gradient norm. test_families_tp.py holds
them to one process computing the same step with the plain model.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from baton.common.config import ModelConfig
from baton.common.model import CausalLM, build_model
from baton.train.config import OptimConfig
from baton.train.parallel.layout import ParallelConfig, check_layout
from baton.train.parallel.mesh import build_mesh
from baton.train.parallel.parallelize import Parallel3D

BASE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.1,
)
SLIDING = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])
FAMILIES: dict[str, dict] = {
    "qwen3": dict(model_type="qwen3"),  # q/k norms per head
    "olmo2": dict(model_type="olmo2"),  # q/k norms over the whole projection, post-norms
    # sandwich norms with Gemma's offset, scaled embeddings, its own softmax scale, a rope per layer type
    "gemma3_text": dict(
        model_type="gemma3_text",
        query_pre_attn_scalar=12,
        final_logit_softcapping=5.0,
        rope_theta=100000.0,
        sliding_rope_theta=10000.0,
        **SLIDING,
    ),
    "gemma2": dict(model_type="gemma2", attn_logit_softcapping=3.0, final_logit_softcapping=5.0, **SLIDING),
    # sinks (sharded by head), the router's bias, stacked experts with biases (replicated over tp)
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, **SLIDING),
    # routed experts in one layer, a dense MLP in the other
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=[1],
    ),
}
SEQ, BATCH, MICRO_BATCHES = 16, 4, 2
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1)
CLIP = 1.0


def model(family: str) -> CausalLM:
    """The family's model with every 1-D weight (norms, biases, sinks) moved off its initial value."""
    torch.manual_seed(0)  # (gpt-oss's stacked experts initialise from the global generator, not build_model's seed)
    m = build_model(ModelConfig(**BASE, **FAMILIES[family]), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, BASE["vocab_size"], (BATCH, SEQ + 1), generator=g)


def run(family: str, sequence_parallel: bool, out: Path) -> None:
    m = model(family)
    layout = check_layout(ParallelConfig(tp=2, sequence_parallel=sequence_parallel), m.config, 2, MICRO_BATCHES, SEQ)
    engine = Parallel3D(m, build_mesh(layout), MICRO_BATCHES, OPTIM)
    loss = engine.forward_backward(list(batch().chunk(MICRO_BATCHES)))
    grads = engine.full_gradients()  # collective
    _, norm = engine.clip_and_step(OPTIM.lr, CLIP, True)
    if dist.get_rank() == 0:
        rec = {"loss": loss.item(), "grads": grads, "norm": norm}
        torch.save(rec, out / f"{family}-{'sp' if sequence_parallel else 'nosp'}.pt")


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        for family in FAMILIES:
            for sp in (False, True):
                run(family, sp, out)
                gc.collect()
                dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
