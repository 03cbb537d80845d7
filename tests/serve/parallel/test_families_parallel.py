"""The 2025-26 families served sharded: T=2, P=2 and T=2 x P=2 greedy tokens equal the single-process
engine's, for Qwen3 (q/k norms per head; one KV head replicated on two tensor ranks), Qwen3-MoE
(experts tensor- and expert-parallel, a dense layer among the MoE ones), Gemma 2 and 3 (sandwich
norms with Gemma's offset, soft-capping, sliding layers with a rope of their own), OLMo 2 (q/k norms
over the whole projection: a rank's slice of the weight, the mean of squares all-reduced; at T=4
too, where each KV head is replicated on two ranks) and gpt-oss (sinks split by head; stacked experts
cut along their width or dealt out whole), and a GPTQ int4 checkpoint of gpt-oss.

The single-process engine equals transformers' generate on these checkpoints (tests/serve/test_families.py);
here the sharded engines must equal it. One pool of worker processes is started for the whole file
and serves every case in turn, joining each case's group the way a torchrun-launched rank does
(start_distributed's launched path: the driver in this process, the workers' worker_main per case),
so the processes and their imports are paid once, not once per layout.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
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
from baton.serve.parallel.shard import ExpertParallelMoE, TensorParallelRMSNorm
from baton.serve.quantization import QuantConfig, quantize_model, save_quantized
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

from ..conftest import run_staggered
from ..test_families import make_family_checkpoint

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


def _config(moe: str = "auto") -> EngineConfig:
    return EngineConfig(
        num_kv_blocks=64,
        block_size=8,
        scheduler=SchedulerConfig(max_num_batched_tokens=16),  # the longer prompts are chunked
        parallel=ParallelConfig(moe_parallel=moe, distributed_timeout_s=120),
    )


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


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RUNS))
def test_sharded_family_greedy_equals_single_process(tmp_path, case, pool, monkeypatch):
    ckpt = _checkpoint(tmp_path, case)
    prompts = _prompts()
    single = LLMEngine.from_checkpoint(ckpt, _config())
    expected = run_staggered(single, prompts, GREEDY, every=2)
    whole = weight_bytes(single.model)
    for layout, moe in RUNS[case][1]:
        engine = pool.engine(ckpt, _config(moe), layout, monkeypatch)
        try:
            got = run_staggered(engine, prompts, GREEDY, every=2)
            _check_shards(engine, case, layout, moe, whole)
        finally:
            engine.shutdown()
        assert got == expected, f"{case} at {layout} (moe {moe})"
