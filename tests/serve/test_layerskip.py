"""LayerSkip self-speculation: the draft is the engine's own model cut at layer E (no second copy),
writing its K/V into the engine's own cache, which the verification reuses (rows enter at layer
E); a depth to draft from is required before a server binds its port. Exactness (greedy with
preemption and prefix caching, the sampled distribution, T=2) is in test_speculative.py and
parallel/test_parallel_speculative.py with the other methods; the reuse on tensor-parallel ranks
(and P=2's mirror) in parallel/test_parallel_layerskip.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.runner.late_entry import install_late_entry
from baton.serve.runner.model_runner import ModelRunner
from baton.serve.sampling_params import SamplingParams
from baton.serve.speculative import SpeculativeConfig

from .conftest import run_staggered_logprobs

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("layerskip")
    save_model(d / "plain", build_model(CFG, seed=0))
    save_model(d / "exits", build_model(dataclasses.replace(CFG, early_exit_layers=[2]), seed=0))
    return d


def test_the_draft_is_the_engines_model_cut_at_the_recorded_exit(checkpoints):
    engine = LLMEngine.from_checkpoint(
        checkpoints / "exits", EngineConfig(num_kv_blocks=16, speculative=SpeculativeConfig("layerskip", 3))
    )
    proposer = engine.speculative.proposer
    assert proposer.exit_layer == 2  # the checkpoint's first recorded exit
    # the same modules and the same KV cache: no second copy of the weights, no cache of its own
    assert proposer.runner is engine.runner and proposer.bm is engine.block_manager
    # late entry is installed on the engine's runner from outside, at the draft's depth
    assert engine.runner.step_pass is proposer.drafter and proposer.drafter.exit_layer == 2
    assert engine.speculative.config.describe() == "layerskip k=3 exit_layer=recorded"


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8] * 11, [5] * 30, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


def test_every_row_runs_the_layers_below_the_exit_once(checkpoints):
    """Reuse is what runs: with the draft writing layers < E and the verification entering at E,
    each row the engine computes goes through layer 0 exactly as often as through layer E (the
    mirror draft ran layers < E twice for every proposal, and once more for every prompt)."""
    engine = LLMEngine.from_checkpoint(
        checkpoints / "exits",
        EngineConfig(num_kv_blocks=64, block_size=4, speculative=SpeculativeConfig("layerskip", 3)),
    )
    rows, answered = {0: 0, 2: 0}, []  # rows into layers 0 and E; rows out of E, the last layer

    def count(i: int):
        return lambda m, a, out: rows.__setitem__(i, rows[i] + a[0].shape[1])

    for i in rows:
        engine.runner.layers[i].register_forward_hook(count(i))
    engine.runner.layers[2].register_forward_hook(lambda m, a, out: answered.append(out.shape[1]))
    run_staggered_logprobs(engine, PROMPTS, GREEDY)
    assert sum(answered) < rows[2]  # with prompt chunks in a step, the last layer answers its sampled rows alone
    stats = engine.speculative.stats
    assert stats.proposed > 0 and stats.accepted > 0
    assert (
        engine.speculative.proposer.num_late_rows >= stats.proposed
    )  # every proposal but the last, and each pending token
    assert rows[0] == rows[2], rows


def test_the_reused_cache_and_logits_equal_plain_decodings(checkpoints):
    """Mid-run, every running sequence's cached K/V (all layers, every computed position: layers < E
    written by the draft, the rest by the verification) equals a plain engine's prefill of the same
    tokens, and the finished outputs' logprobs equal plain decoding's: a wrong slot, a stale entry or
    a row entering at E with the wrong hidden state would each show here."""
    spec = EngineConfig(num_kv_blocks=64, block_size=4, speculative=SpeculativeConfig("layerskip", 3))
    engine = LLMEngine.from_checkpoint(checkpoints / "exits", spec)
    run_staggered_logprobs(engine, PROMPTS, GREEDY, until=12)
    running = [s for s in engine.scheduler.running if s.num_computed_tokens > len(s.prompt_token_ids)]
    assert running and engine.speculative.proposer.num_late_rows > 0
    plain = LLMEngine.from_checkpoint(checkpoints / "exits", EngineConfig(num_kv_blocks=64, block_size=4))
    for seq in running:
        n = seq.num_computed_tokens
        plain.add_request(f"p{seq.seq_id}", seq.token_ids[: n + 1], SamplingParams(temperature=0, max_tokens=2))
        plain.step()  # the prefill: K/V of the n + 1 tokens
        (ref,) = [s for s in plain.scheduler.running]
        slot = lambda s, i: s.block_table[i // 4] * 4 + i % 4  # noqa: E731
        for (k, v), (pk, pv) in zip(engine.runner.kv_caches, plain.runner.kv_caches):
            mine = torch.tensor([slot(seq, i) for i in range(n)])
            theirs = torch.tensor([slot(ref, i) for i in range(n)])
            torch.testing.assert_close(k.flatten(0, 1)[mine], pk.flatten(0, 1)[theirs], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v.flatten(0, 1)[mine], pv.flatten(0, 1)[theirs], atol=1e-5, rtol=1e-4)
        plain.abort_request(f"p{seq.seq_id}")
    got = run_staggered_logprobs(LLMEngine.from_checkpoint(checkpoints / "exits", spec), PROMPTS, GREEDY)
    want = run_staggered_logprobs(plain, PROMPTS, GREEDY)
    for i in range(len(PROMPTS)):
        assert got[i][0] == want[i][0]
        torch.testing.assert_close(torch.tensor(got[i][1]), torch.tensor(want[i][1]), atol=1e-4, rtol=0)


def test_late_entry_is_refused_on_a_runner_without_every_layer():
    """The step pass runs layers >= E up to the model's last: a pipeline stage's runner cannot take it
    (such an engine keeps the mirror draft, parallel/test_parallel_layerskip.py)."""
    stage = ModelRunner(build_model(CFG, seed=0), 4, 4, layers=range(2))
    with pytest.raises(ValueError, match="needs every layer on one runner"):
        install_late_entry(stage, 1)
    assert stage.step_pass is None


@pytest.mark.parametrize(
    "checkpoint, exit_layer, words",
    [
        ("plain", None, "records no early exits"),
        ("plain", 3, r"exit_layer must be in 1\.\.2"),
        ("exits", 0, "exit_layer is a layer count >= 1"),
    ],
)
def test_no_depth_to_draft_from_is_refused(checkpoints, checkpoint, exit_layer, words):
    spec = SpeculativeConfig("layerskip", exit_layer=exit_layer)
    with pytest.raises(ValueError, match=words):
        LLMEngine.from_checkpoint(checkpoints / checkpoint, EngineConfig(num_kv_blocks=16, speculative=spec))


def test_refused_before_the_port_is_bound(checkpoints, monkeypatch, capsys):
    import baton.serve.server as server_module
    from baton.common.cli import main

    seen = []
    monkeypatch.setattr(server_module, "run", lambda config: seen.append(config) or 0)
    argv = ["serve", "--model", str(checkpoints / "plain"), "--speculative", "layerskip"]
    assert main(argv) == 2
    assert "records no early exits" in capsys.readouterr().err and not seen
    assert main([*argv, "--exit-layer", "1"]) == 0  # explicit: drafting from layer 1 is allowed
    assert seen[0].engine.speculative.exit_layer == 1
