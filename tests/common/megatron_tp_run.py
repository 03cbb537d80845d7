"""baton_to_megatron's TP shards in megatron-core's GPTModel, one process per TP rank (run by
tests/common/test_megatron_interop.py): each rank loads its own shard strictly, the vocab-parallel
logits are gathered, and rank 0 writes the largest difference from Baton's logits to OUT.

Usage: megatron_tp_run.py TP OUT. The model has one KV head (fewer KV groups than TP ranks, which
megatron handles by all-gathering the fused QKV output), Qwen2 biases and tied embeddings.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))


def rank_main(rank: int, tp: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from baton.common import megatron_compat

    megatron_compat.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    from baton.common.megatron_layout import baton_to_megatron, padded_vocab_size
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from test_megatron_interop import baton_model, gpt_model, megatron_logits

    parallel_state.initialize_model_parallel(tp, 1)
    baton = baton_model("qwen2-mqa-bias-tied")
    cfg, vocab = baton.config, padded_vocab_size(200, tp)
    gpt = gpt_model(cfg, vocab, tp)
    shard = baton_to_megatron(baton.checkpoint_state_dict(), cfg, tp, rank)
    extra = {k: v for k, v in gpt.state_dict().items() if k.endswith("_extra_state")}
    gpt.load_state_dict({**shard, **extra}, strict=True)
    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(megatron_logits(gpt, tokens))
        ref = baton(tokens)
    if rank == 0:
        err = (logits[..., :200] - ref).abs().max().item()
        with open(out, "w") as f:
            json.dump({"max_abs_diff": err, "vocab": logits.shape[-1], "ref_std": ref.std().item()}, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    tp, out = int(sys.argv[1]), sys.argv[2]
    from baton.train.distributed import free_port

    mp.spawn(rank_main, args=(tp, free_port(), out), nprocs=tp)
