"""DeepSeek-V3 served tensor-parallel: T=2 greedy tokens equal the single-process engine's (which equal
transformers', tests/serve/test_mla_serving.py), in real gloo worker processes.

Each rank keeps half the heads - the query's up-projection and kv_b_proj cut by head, o_proj by rows
- and the whole latent cache (the compression is replicated, as in vLLM): its KV bytes are the single
process's, which the ranks' stats must say and the driver's pools must hold. DeepSeekMoE's routed
experts are split (tensor) or dealt out whole (expert) with the shared expert cut like a dense MLP;
the dense checkpoint without the q LoRA runs under swap preemption, so the latent blocks move to and
from every rank's host pool; a checkpoint carrying an MTP module loads sharded without it (the MTP
proposer drafts in a single process). One worker process serves every case in turn (the family
tests' pool).
"""

from __future__ import annotations

import dataclasses

import pytest
from baton.common.checkpoint import read_config, save_model, tensor_names
from baton.common.deepseek_moe import DeepSeekMoE
from baton.common.model import build_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.parallel.config import ParallelConfig
from baton.serve.parallel.driver import DistributedRunner
from baton.serve.parallel.loader import weight_bytes
from baton.serve.parallel.shard import ExpertParallelMoE
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

from ..conftest import run_staggered
from ..test_mla_serving import make_deepseek_checkpoint, prompts
from .test_families_parallel import WorkerPool

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
RUNS = {  # case -> [(moe_parallel, preemption)]
    "q_lora-moe": [("tensor", None), ("expert", None)],
    "no_q_lora-yarn": [("auto", "swap")],
    "mtp-weights": [("auto", None)],  # a checkpoint carrying an MTP module: the ranks do not read it
}


def _config(moe: str, preempt: str | None) -> EngineConfig:
    par = ParallelConfig(moe_parallel=moe, distributed_timeout_s=120)
    if preempt is not None:
        sched = SchedulerConfig(max_num_batched_tokens=32, preemption_mode=preempt)
        return EngineConfig(num_kv_blocks=12, block_size=8, scheduler=sched, parallel=par)
    return EngineConfig(
        num_kv_blocks=96, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=16), parallel=par
    )


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    workers = WorkerPool(1, tmp_path_factory.mktemp("rendezvous"))
    yield workers
    workers.close()


def _check_shards(engine: LLMEngine, single: LLMEngine, moe: str) -> None:
    runner, cfg = engine.runner, engine.model_config
    assert isinstance(runner, DistributedRunner) and runner.topo.tp == 2
    local = runner.local
    assert max(runner.topo.stats["weight_bytes"]) < weight_bytes(single.model)
    layer = local.model.model.layers[0]
    attn, heads = layer.self_attn, cfg.num_attention_heads // 2
    assert attn.num_heads == heads
    assert attn.kv_b_proj.out_features == heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    assert attn.o_proj.in_features == heads * cfg.v_head_dim
    # the latent cache is replicated: every rank holds the single process's bytes
    per_token = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    kv = runner.num_blocks * runner.block_size * cfg.num_hidden_layers * per_token * 4
    assert runner.topo.stats["kv_bytes"] == [kv, kv]
    assert sum(p[0].nbytes for p in local.kv_caches) == kv
    assert all(p[0].shape[1:] == (runner.block_size, per_token) for p in local.kv_caches)
    blocks = [x.ffn for x in local.layers if isinstance(x.ffn, DeepSeekMoE)]
    if cfg.num_local_experts and cfg.first_k_dense_replace < cfg.num_hidden_layers:
        assert blocks and all(isinstance(b, ExpertParallelMoE) == (moe == "expert") for b in blocks)
        shared = blocks[0].shared_experts
        assert shared.gate_proj.out_features == cfg.expert_intermediate_size * cfg.n_shared_experts // 2


def _checkpoint(tmp_path, name: str):
    if name != "mtp-weights":
        return make_deepseek_checkpoint(tmp_path, name)[1]
    cfg = read_config(make_deepseek_checkpoint(tmp_path, "no_q_lora-yarn")[1])
    cfg.num_nextn_predict_layers = 1
    ckpt = save_model(tmp_path / "with-mtp", build_model(cfg, seed=1))
    assert any(n.startswith(f"model.layers.{cfg.num_hidden_layers}.") for n in tensor_names(ckpt))
    return ckpt


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_tensor_parallel_greedy_equals_single_process(tmp_path, name, pool, monkeypatch):
    ckpt = _checkpoint(tmp_path, name)
    ps = prompts()[:5]
    for moe, preempt in RUNS[name]:
        config = _config(moe, preempt)
        single = LLMEngine.from_checkpoint(ckpt, dataclasses.replace(config, parallel=ParallelConfig()))
        expected = run_staggered(single, ps, GREEDY, every=2)
        engine = pool.engine(ckpt, config, "T2", monkeypatch)
        try:
            got = run_staggered(engine, ps, GREEDY, every=2)
            _check_shards(engine, single, moe)
            bm = engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks and len(bm.host_free) == bm.num_host_blocks
            if preempt is not None:
                assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
        finally:
            engine.shutdown()
        assert got == expected, f"{name} at T2 (moe {moe}, preemption {preempt})"
