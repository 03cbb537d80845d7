"""The 2025-26 families served sharded: T=2, P=2 and T=2 x P=2 greedy tokens equal the single-process
engine's, for Qwen3 (q/k norms per head; one KV head replicated on two tensor ranks), Qwen3-MoE
(experts tensor- and expert-parallel, a dense layer among the MoE ones), Gemma 2 and 3 (sandwich
norms with Gemma's offset, soft-capping, sliding layers with a rope of their own), OLMo 2 (q/k norms
over the whole projection: a rank's slice of the weight, the mean of squares all-reduced; at T=4
too, where each KV head is replicated on two ranks) and gpt-oss (sinks split by head; stacked experts
cut along their width or dealt out whole), and a GPTQ int4 checkpoint of gpt-oss.

KV groups: the families mixing sliding and full layers keep the sliding layers' KV in a pool of
their own on every rank too. Gemma 3's and gpt-oss's layouts run it under preemption - by recompute
at some layouts, by swap at the others - with 13 full-layer blocks of 4 tokens and the sliding pool
sized to what two sequences use (12 blocks); their reference is the single process with the same
pools, which must also equal its run with one group for every layer. The stats and each rank's KV
bytes say the smaller pool exists where a rank holds sliding layers. A second Gemma 3 (the one of
tests/serve/test_kv_groups.py, whose greedy runs do not repeat) runs lookahead decoding at T2 x P2,
where accepted tree paths move the sliding layers' slots on every rank.

The single-process engine equals transformers' generate on these checkpoints (tests/serve/test_families.py);
here the sharded engines must equal it. One pool of worker processes is started for the whole file
and serves every case in turn, joining each case's group the way a torchrun-launched rank does
(start_distributed's launched path: the driver in this process, the workers' worker_main per case),
so the processes and their imports are paid once, not once per layout.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from collections import Counter
from pathlib import Path

import pytest
import torch
from baton.common.checkpoint import load_checkpoint
from baton.common.launch import Launch
from baton.common.moe import MoE
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.parallel.config import ParallelConfig
from baton.serve.parallel.driver import DistributedRunner
from baton.serve.parallel.loader import weight_bytes
from baton.serve.parallel.shard import ExpertParallelMoE, TensorParallelRMSNorm, stage_layers
from baton.serve.quantization import QuantConfig, quantize_model, save_quantized
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

from ..conftest import run_staggered
from ..test_families import make_family_checkpoint
from ..test_kv_groups import make_gemma3
from ..test_kv_groups import prompts as gemma3_prompts

LAYOUTS = {"T2": (2, 1), "P2": (1, 2), "T2xP2": (2, 2), "T4": (4, 1)}
RUNS = {  # case -> (family, [(layout, moe_parallel)])
    "qwen3": ("qwen3", [("T2", "auto"), ("P2", "auto")]),
    "qwen3-mqa-tied-sliding": ("qwen3-mqa-tied-sliding", [("T2xP2", "auto")]),
    "qwen3_moe": ("qwen3_moe", [("T2", "tensor"), ("P2", "auto"), ("T2xP2", "expert")]),
    "gemma3_text": ("gemma3_text", [("T2", "auto"), ("P2", "auto"), ("T2xP2", "auto")]),
    "gemma2": ("gemma2", [("T2", "auto"), ("T2xP2", "auto")]),
    "olmo2": ("olmo2", [("T2", "auto"), ("P2", "auto"), ("T2xP2", "auto"), ("T4", "auto")]),
    "gpt_oss": ("gpt_oss", [("T2", "expert"), ("P2", "auto"), ("T2xP2", "tensor")]),
    "gpt_oss-gptq": ("gpt_oss", [("T2", "expert"), ("T2xP2", "tensor")]),
    "gemma3-lookahead": ("gemma3-kv-groups", [("T2xP2", "auto")]),
}
# KV groups under preemption (module docstring): the preemption mode at these layouts
PREEMPT = {
    ("gemma3_text", "T2"): "recompute",
    ("gemma3_text", "P2"): "swap",
    ("gemma3_text", "T2xP2"): "recompute",
    ("gpt_oss", "T2"): "swap",
    ("gpt_oss", "P2"): "recompute",
    ("gpt_oss", "T2xP2"): "swap",
}
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# The worker pool's processes: each serves one case after another (worker_main returns on "stop").
POOL = """
from baton.serve.parallel.worker import worker_main
while (job := jobs.get()) is not None:
    world, init, par = job
    worker_main(rank, world, init, par, "cpu", (rank, world))
"""


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 301, (n,), generator=g).tolist() for n in (3, 29, 11, 20)]


def _config(moe: str = "auto", case: str = "", preempt: str | None = None) -> EngineConfig:
    par = ParallelConfig(moe_parallel=moe, distributed_timeout_s=120)
    if case == "gemma3-lookahead":  # the sliding pool sized for 4 sequences: 32 blocks of the full layers' 128
        spec = SpeculativeConfig("lookahead", lookahead_window=3, lookahead_ngram=3, lookahead_guesses=3)
        sched = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)
        return EngineConfig(num_kv_blocks=128, block_size=4, scheduler=sched, speculative=spec, parallel=par)
    if preempt is not None:  # 13 blocks for the full layers, 12 for the sliding ones (2 sequences' windows, a step)
        sched = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2, preemption_mode=preempt)
        return EngineConfig(num_kv_blocks=13, block_size=4, scheduler=sched, parallel=par)
    sched = SchedulerConfig(max_num_batched_tokens=16)  # the longer prompts are chunked
    return EngineConfig(num_kv_blocks=64, block_size=8, scheduler=sched, parallel=par)


class WorkerPool:
    """Ranks 1..size, spawned once; `engine` starts a case's group with this process as rank 0."""

    def __init__(self, size: int, rendezvous_dir: Path):
        ctx = mp.get_context("spawn")
        self.jobs = [ctx.Queue() for _ in range(size)]
        self.procs = [
            ctx.Process(target=exec, args=(POOL, {"jobs": q, "rank": r + 1}), name=f"pool-{r + 1}", daemon=True)
            for r, q in enumerate(self.jobs)
        ]
        for p in self.procs:
            p.start()
        self.dir, self.cases = rendezvous_dir, 0

    def engine(self, ckpt: Path, config: EngineConfig, layout: str, monkeypatch) -> LLMEngine:
        t, p = LAYOUTS[layout]
        world = t * p
        par = dataclasses.replace(config.parallel, tensor_parallel_size=t, pipeline_parallel_size=p)
        self.cases += 1
        init = f"file://{self.dir / f'case-{self.cases}'}"
        dead = [p.name for p in self.procs[: world - 1] if not p.is_alive()]
        assert not dead, f"pool workers {dead} died in an earlier case"
        for q in self.jobs[: world - 1]:
            q.put((world, init, par))
        launch = Launch(rank=0, world_size=world, source="launcher", local_world_size=world)
        monkeypatch.setattr("baton.serve.parallel.launched_rank", lambda: launch)
        monkeypatch.setattr("baton.serve.parallel.rendezvous", lambda _launch: init)
        return LLMEngine.from_checkpoint(ckpt, dataclasses.replace(config, parallel=par))

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    workers = WorkerPool(3, tmp_path_factory.mktemp("rendezvous"))
    yield workers
    workers.close()


def _checkpoint(tmp: Path, case: str) -> Path:
    family = RUNS[case][0]
    if family == "gemma3-kv-groups":
        return make_gemma3(tmp)[1]
    _, ckpt = make_family_checkpoint(tmp, family)
    if not case.endswith("-gptq"):
        return ckpt
    model = load_checkpoint(ckpt, dtype=torch.float32).model
    calib = torch.randint(0, 301, (8, 32), generator=torch.Generator().manual_seed(1))
    qcfg = QuantConfig("gptq", 4, 32)
    return save_quantized(tmp / "gptq", quantize_model(model, qcfg, calib), qcfg)


def _check_shards(engine: LLMEngine, case: str, layout: str, moe: str, whole: int) -> None:
    """Each rank holds less than the whole model, and the driver's shard has the families' pieces."""
    runner = engine.runner
    t, p = LAYOUTS[layout]
    assert isinstance(runner, DistributedRunner) and runner.steps > 0
    assert (runner.topo.tp, runner.topo.pp) == (t, p)
    assert max(runner.topo.stats["weight_bytes"]) < whole, runner.topo.stats["weight_bytes"]
    if t == 1:
        return
    layer = runner.local.model.model.layers[runner.local.layer_ids[0]]
    attn = layer.self_attn
    cfg = runner.model_config
    assert attn.num_heads == cfg.num_attention_heads // t
    if cfg.qk_norm == "full":
        assert isinstance(attn.q_norm, TensorParallelRMSNorm) and attn.q_norm.weight.numel() == attn.num_heads * 16
    if cfg.attention_sinks:
        assert attn.sinks.shape == (attn.num_heads,)
    if cfg.num_local_experts:
        layers = [runner.local.model.model.layers[i] for i in runner.local.layer_ids]
        block = next(x.ffn for x in layers if isinstance(x.ffn, MoE))
        assert isinstance(block, ExpertParallelMoE) == (moe == "expert"), (case, layout, moe)


def _spy_window_ops(runner) -> Counter:
    """Counts the sliding layers' swaps and slot moves the engine hands the driver (every rank applies them)."""
    counts: Counter = Counter()
    apply, move = runner.apply_block_ops, runner.move_slots

    def apply_block_ops(ops):
        if ops.window is not None:
            counts.update(swap_out=len(ops.window.swap_out), swap_in=len(ops.window.swap_in))
        apply(ops)

    def move_slots(src, dst, window_src=None, window_dst=None):
        counts["moves"] += len(window_src or [])
        move(src, dst, window_src, window_dst)

    runner.apply_block_ops, runner.move_slots = apply_block_ops, move_slots
    return counts


def _check_kv_groups(engine: LLMEngine, single: LLMEngine, counts: Counter, preempt: str | None) -> None:
    """The sharded engine kept the sliding layers' pool of the single process's size, freed their
    old blocks, and gave every block of both groups back; its ranks allocated what the stats say."""
    bm, w, runner = engine.block_manager, engine.block_manager.window, engine.runner
    assert w is not None and w.num_dropped > 0, "the sliding layers' old blocks were meant to be freed"
    stats, ref = engine.stats(), single.stats()
    assert 0 < stats.kv_window_blocks_total == ref.kv_window_blocks_total == runner.num_window_blocks
    assert stats.kv_blocks_total == ref.kv_blocks_total and bm.problem([]) is None
    assert (stats.kv_blocks_free, stats.kv_window_blocks_free) == (stats.kv_blocks_total, w.num_blocks)
    local, rank_stats = runner.local, runner.topo.stats
    assert local.window_layers and all(local.kv_caches[i][0].shape[0] == w.num_blocks for i in local.window_layers)
    assert all(local.kv_caches[i][0].shape[0] == bm.num_blocks for i in local.full_layers)
    allocated = sum(t.nbytes for i in local.window_layers + local.full_layers for t in local.kv_caches[i])
    assert allocated == rank_stats["kv_bytes"][0]  # the driver is rank 0
    cfg, (t, p) = runner.model_config, (runner.topo.tp, runner.topo.pp)
    for r, (kv, block) in enumerate(zip(rank_stats["kv_bytes"], rank_stats["kv_block_bytes"])):
        sliding = any(cfg.is_sliding(i) for i in stage_layers(cfg.num_hidden_layers, p, r // t))
        assert (kv < block * bm.num_blocks) == (sliding and w.num_blocks < bm.num_blocks), (r, rank_stats)
    if preempt is not None:
        assert engine.scheduler.num_preemptions > 0, "the small pools were meant to force preemption"
    if preempt == "swap":
        assert counts["swap_out"] > 0 and counts["swap_in"] > 0, counts


def _single(ckpt: Path, config: EngineConfig, prompts: list[list[int]]) -> tuple[LLMEngine, list[list[int]]]:
    """The single-process engine and its greedy tokens; with KV groups, equal to its run without them."""
    engine = LLMEngine.from_checkpoint(ckpt, config)
    got = run_staggered(engine, prompts, GREEDY, every=2)
    if engine.block_manager.window is not None:
        one_group = LLMEngine.from_checkpoint(ckpt, dataclasses.replace(config, kv_cache_groups=False))
        assert run_staggered(one_group, prompts, GREEDY, every=2) == got, "KV groups changed the tokens"
    return engine, got


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RUNS))
def test_sharded_family_greedy_equals_single_process(tmp_path, case, pool, monkeypatch):
    ckpt = _checkpoint(tmp_path, case)
    prompts = gemma3_prompts()[:4] if case == "gemma3-lookahead" else _prompts()
    references: dict[str | None, tuple[LLMEngine, list[list[int]]]] = {}
    for layout, moe in RUNS[case][1]:
        preempt = PREEMPT.get((case, layout))
        if preempt not in references:
            references[preempt] = _single(ckpt, _config(case=case, preempt=preempt), prompts)
        single, expected = references[preempt]
        engine = pool.engine(ckpt, _config(moe, case, preempt), layout, monkeypatch)
        counts = _spy_window_ops(engine.runner)
        try:
            got = run_staggered(engine, prompts, GREEDY, every=2)
            _check_shards(engine, case, layout, moe, weight_bytes(single.model))
            if single.block_manager.window is not None:
                _check_kv_groups(engine, single, counts, preempt)
            if engine.speculative is not None:
                assert engine.speculative.stats == single.speculative.stats
                assert counts["moves"] > 0, "accepted tree paths were meant to move the sliding layers' slots"
        finally:
            engine.shutdown()
        assert got == expected, f"{case} at {layout} (moe {moe}, preemption {preempt})"
