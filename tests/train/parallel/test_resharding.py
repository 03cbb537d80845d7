"""A DCP checkpoint saved at TP=2 x PP=2 (4 ranks) resumes at DP=2 (FSDP) and on 1 process and
continues exactly like the run that never stopped; exported, it is what the server generates from."""

from __future__ import annotations

import pytest
import torch

from baton.common.model import CausalLM, greedy_generate
from baton.serve.engine import EngineConfig
from baton.serve.llm import LLM
from baton.serve.sampling_params import SamplingParams
from baton.train.export import write_handoff
from baton.train.parallel.checkpoint import read_dcp

from .conftest import max_rel
from .harness import MODEL, SAVE_AT, STEPS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", ["resume_dp2", "resume_1"])
def test_resume_at_another_layout_continues_the_run(harness, reference, case):
    saved, resumed = harness.result("tp2_pp2"), harness.result(case)
    assert resumed["start"] == SAVE_AT and len(resumed["losses"]) == STEPS - SAVE_AT  # data position restored
    # The weights are those saved, bit for bit, re-sharded to the new layout ...
    assert max_rel(resumed["weights_before"][0], saved["weights_before"][SAVE_AT]) == 0.0
    # ... and so is AdamW's state: without its moments the first update would differ by ~lr.
    assert max_rel(resumed["weights_before"][1], saved["weights_before"][SAVE_AT + 1]) < 1e-5
    for other in (saved["losses"][SAVE_AT:], reference["losses"][SAVE_AT:]):
        rel = [abs(a - b) / b for a, b in zip(resumed["losses"], other)]
        assert max(rel) < 1e-5, rel


def test_checkpoint_reads_as_whole_tensors(harness):
    run = harness.result("tp2_pp2")
    state = read_dcp(harness.root / "tp2_pp2" / f"step_{STEPS}")
    assert max_rel(state.weights, run["weights"]) == 0.0
    assert state.step == STEPS and state.exp_avg.keys() == state.weights.keys() == state.exp_avg_sq.keys()


def test_export_is_served_with_the_trainers_greedy_output(harness, tmp_path):
    run = harness.result("tp2_pp2")
    weights = read_dcp(harness.root / "tp2_pp2" / f"step_{STEPS}", with_optimizer=False).weights
    handoff = write_handoff(tmp_path / "handoff", MODEL, weights)
    trained = CausalLM(MODEL)
    trained.load_state_dict(run["weights"])  # the trainer's model at the end, gathered from its 4 ranks
    prompts = [[5, 10, 15, 20], [7, 9, 11, 13, 15]]
    llm = LLM(handoff, EngineConfig(num_kv_blocks=32, block_size=8))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        expected = greedy_generate(trained, torch.tensor([prompt]), 8)[0].tolist()
        assert out.outputs[0].token_ids == expected
