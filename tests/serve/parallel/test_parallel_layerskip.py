"""LayerSkip's KV reuse on a tensor-parallel (T=2) engine: the draft's layers < E run sharded on
every rank, into the ranks' own caches, and the verification's drafted rows enter at E from the
hidden states each rank kept (serve/runner/late_entry.py). Against plain decoding (greedy: the same
tokens) and the single-process reuse path (the same proposals, acceptance and late rows; a seeded
sampled request draws the same tokens, so the sampled path is the one test_speculative.py checks
for distribution), with mixed-length prompts arriving at different steps, a shared prefix (prefix
cache hits), chunked prefill and a pool small enough to preempt (by recompute, and by swap: the
swapped sequences' entries no longer fit their slots). Pipeline stages keep the mirror draft."""

from __future__ import annotations

import pytest
from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.parallel.loader import weight_bytes
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

from .conftest import Arrival, check_really_sharded, drive, sharded, tokens

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    early_exit_layers=[2],
)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
SHARED = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]  # three blocks of 4: the second prompt hits them
PROMPTS = [SHARED + [7, 7], [9, 8] * 11, SHARED + [2], [5] * 30, [1, 2, 3, 4, 5, 6, 7], [11, 12, 13] * 5]


def _workload(sampled: bool) -> list[Arrival]:
    arrivals = [Arrival(2 * i, str(i), p, GREEDY) for i, p in enumerate(PROMPTS)]
    if sampled:
        arrivals.append(Arrival(1, "seeded", [4, 4, 2, 9, 1], SEEDED))
    return arrivals


def _config(speculative: bool, preemption: str = "recompute") -> EngineConfig:
    return EngineConfig(
        num_kv_blocks=20,
        block_size=4,
        speculative=SpeculativeConfig("layerskip", 3) if speculative else None,
        scheduler=SchedulerConfig(max_num_batched_tokens=24, preemption_mode=preemption),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("parallel-layerskip")
    save_model(d, build_model(CFG, seed=0))
    return d


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_layerskip_reuses_the_draft_kv_on_tensor_parallel_ranks(model_dir, preemption):
    want = tokens(drive(LLMEngine.from_checkpoint(model_dir, _config(False)), _workload(False)))
    single = LLMEngine.from_checkpoint(model_dir, _config(True, preemption))
    ref = tokens(drive(single, _workload(True)))
    assert {k: v for k, v in ref.items() if k != "seeded"} == want
    assert single.scheduler.num_preemptions > 0 and single.block_manager.prefix_hits > 0
    assert single.speculative.stats.accepted > 0 and single.speculative.proposer.num_late_rows > 0
    with sharded(model_dir, _config(True, preemption), "T2") as llm:
        engine = llm.engine
        got = tokens(drive(engine, _workload(True)))
        runner = check_really_sharded(engine, "T2", weight_bytes(single.model))
        proposer = engine.speculative.proposer
        assert (
            proposer.sharded and proposer.runner is proposer.drafter is runner
        )  # no mirror: the engine's own ranks draft
        stats, late, preempted = engine.speculative.stats, runner.num_late_rows, engine.scheduler.num_preemptions
    assert got == ref
    assert preempted == single.scheduler.num_preemptions > 0
    assert stats == single.speculative.stats
    assert (
        late == single.speculative.proposer.num_late_rows > 0
    )  # the reuse path ran, for the very rows it ran for in one process


def test_layerskip_keeps_the_mirror_draft_on_pipeline_stages(model_dir):
    """P=2: layers < E and the LM head are on different stages, so the draft is the mirror (the
    checkpoint's first E layers in the driver, their own cache): exact, and nothing enters late."""
    want = tokens(drive(LLMEngine.from_checkpoint(model_dir, _config(False)), _workload(False)))
    with sharded(model_dir, _config(True), "P2") as llm:
        got = tokens(drive(llm.engine, _workload(False)))
        proposer = llm.engine.speculative.proposer
        assert not proposer.reuse and not proposer.sharded and proposer.runner is not llm.engine.runner
        assert llm.engine.runner.num_late_rows == 0 and llm.engine.speculative.stats.accepted > 0
    assert got == want
