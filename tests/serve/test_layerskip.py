"""LayerSkip self-speculation: the draft is the engine's own model cut at layer E (no second copy),
and a depth to draft from is required before a server binds its port. Exactness (greedy with
preemption and prefix caching, the sampled distribution, T=2) is in test_speculative.py and
parallel/test_parallel_speculative.py with the other methods."""

from __future__ import annotations

import dataclasses

import pytest

from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.speculative import SpeculativeConfig

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
    assert proposer.runner.model is engine.runner.model  # the same modules: no second copy of the weights
    assert proposer.runner.layers == engine.runner.layers[:2]
    assert [c is None for c in proposer.runner.kv_caches] == [False, False, True]  # KV for layers < E only
    assert engine.speculative.config.describe() == "layerskip k=3 exit_layer=recorded"


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
