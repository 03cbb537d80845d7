"""Quantized checkpoints served sharded, for real: worker processes, their groups, LLM(...).

GPTQ int4 (fp32 activations) gives exactly the single-process engine's greedy tokens at T=2 and at
T=2 x P=2. RTN int8 on CPU serves with bf16 activations (quantization/loader.py's fast path), so
each row-parallel rank rounds its partial product to bf16 before the sum: its logits differ from
T=1 by bf16 rounding (measured: at most 0.015 in log-probability), and a free-running greedy
decode of a random model (whose top-2 gaps go down to ~0.003) can flip at a near tie and then
diverge. So int8 is compared teacher-forced: every prefix of the T=1 greedy continuation, one token
each, the same token wherever T=1's choice is not a near tie, and log-probabilities within that
rounding everywhere. Every run's ranks report the weight bytes test_parallel_memory derives from the
checkpoint. A layout that would cut an int4 quantization group is refused before any process starts."""

from __future__ import annotations

import psutil
import pytest
import torch

from baton.serve.engine import EngineConfig
from baton.serve.llm import LLM
from baton.serve.parallel.shard import Shard
from baton.serve.sampling_params import SamplingParams

from .test_parallel_memory import expected_rank_bytes
from .test_shard_loading import DENSE, checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
_G = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(0, DENSE["vocab_size"], (n,), generator=_G).tolist() for n in (5, 23, 11, 40)]
PROMPTS.append([7, 8, 9, 10, 11] * 6)
CONFIG = EngineConfig(num_kv_blocks=256, block_size=8)
BF16_LOGPROB = 0.03  # twice the largest T=2 vs T=1 log-probability difference measured for int8 on CPU


def _rank_bytes(d, tp: int, pp: int) -> list[int]:
    """Expected weight bytes of ranks 0..T*P-1 (rank = pipeline stage * T + tensor rank)."""
    return [sum(expected_rank_bytes(d, Shard(r % tp, tp, r // tp, pp)).values()) for r in range(tp * pp)]


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.slow
def test_gptq_int4_sharded_greedy_equals_single_process(tmp_path_factory):
    d = checkpoint(tmp_path_factory, "gptq-int4")
    with LLM(d, CONFIG) as llm:
        want = _greedy(llm, PROMPTS)
    for tp, pp in ((2, 1), (2, 2)):
        with LLM(d, CONFIG, tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
            assert _greedy(llm, PROMPTS) == want, (tp, pp)
            assert llm.engine.runner.topo.stats["weight_bytes"] == _rank_bytes(d, tp, pp)


@pytest.mark.slow
def test_int8_tensor_parallel_equals_single_process_teacher_forced(tmp_path_factory):
    d = checkpoint(tmp_path_factory, "rtn-int8")
    top2 = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    with LLM(d, CONFIG) as llm:
        forced = [p + c[:k] for p, c in zip(PROMPTS, _greedy(llm, PROMPTS)) for k in range(12)]
        want = [o.outputs[0] for o in llm.generate(forced, top2)]
    with LLM(d, CONFIG, tensor_parallel_size=2) as llm:
        got = [o.outputs[0] for o in llm.generate(forced, top2)]
        held = llm.engine.runner.topo.stats["weight_bytes"]
    flips = 0
    for w, g in zip(want, got):
        (token,), alternatives = w.token_ids, w.logprobs[0]
        gap = alternatives[token] - max(v for t, v in alternatives.items() if t != token)
        assert token in g.logprobs[0], f"T=1's token {token} is not in T=2's top 2 {g.logprobs[0]}"
        assert abs(g.logprobs[0][token] - alternatives[token]) < BF16_LOGPROB, (w, g)
        if g.token_ids != w.token_ids:
            assert gap < 2 * BF16_LOGPROB, f"T=2 chose {g.token_ids} over T=1's {token} (gap {gap:.3f}): not a near tie"
            flips += 1
    assert flips <= len(forced) // 10, flips
    assert held == _rank_bytes(d, 2, 1)


def test_int4_layout_that_cuts_a_group_is_refused_before_any_process(tmp_path_factory):
    d = checkpoint(tmp_path_factory, "int4-misaligned")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError) as err:
        LLM(d, CONFIG, tensor_parallel_size=2)
    assert str(err.value).startswith(
        "the MLP input (96) split 2 ways is 48 columns, not whole int4 quantization groups of 32"
    )
    # Refused by start_distributed's layout check: the driver (which spawns the workers) never ran.
    assert any(e.name == "check_layout" for e in err.traceback)
    assert not [e for e in err.traceback if str(e.path).endswith("driver.py")]
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before
