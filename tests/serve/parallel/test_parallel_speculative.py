"""Lookahead and token trees on a tensor-parallel (T=2) model: the outputs of plain greedy decoding,
and the very proposals and acceptance of the single-process engine (the window rows and the
dynamic draft tree are built from logits the ranks all-reduce, so they must agree). The
checkpoints and workload are test_parallel_features.py's: mixed-length prompts arriving at
different steps, a repetitive one among them."""

from __future__ import annotations

import pytest
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.parallel.loader import weight_bytes
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

from .conftest import check_really_sharded, drive, sharded, tokens
from .test_parallel_features import LOOP, _plain, model_dir  # noqa: F401 (fixture)

GROUPS = {
    "lookahead": lambda d: SpeculativeConfig("lookahead", lookahead_window=3, lookahead_ngram=3, lookahead_guesses=3),
    "draft-tree": lambda d: SpeculativeConfig("draft", 3, draft_model=str(d / "draft"), tree_width=2, tree_nodes=6),
    # under T=2 the ranks draft with their shards of the first layer, into their own caches (KV reuse)
    "layerskip": lambda d: SpeculativeConfig("layerskip", 3, exit_layer=1),
}


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_speculative_tree_on_tensor_parallel_model(model_dir, group):  # noqa: F811
    plain_cfg = EngineConfig(num_kv_blocks=96, block_size=8)
    plain = LLMEngine.from_checkpoint(model_dir / "target", plain_cfg)
    workload = _plain(plain.vocab_size, (LOOP,))
    want = tokens(drive(plain, workload))
    cfg = EngineConfig(
        num_kv_blocks=40,
        block_size=8,
        speculative=GROUPS[group](model_dir),
        scheduler=SchedulerConfig(max_num_batched_tokens=32),  # chunked prefill beside the trees
    )
    single = LLMEngine.from_checkpoint(model_dir / "target", cfg)
    assert tokens(drive(single, workload)) == want
    assert single.speculative.stats.accepted > 0
    with sharded(model_dir / "target", cfg, "T2") as llm:
        got = tokens(drive(llm.engine, workload))
        check_really_sharded(llm.engine, "T2", weight_bytes(single.model))
        stats = llm.engine.speculative.stats
    assert got == want
    assert stats == single.speculative.stats


@pytest.mark.slow
def test_eagle_on_tensor_parallel_model(model_dir, tmp_path):  # noqa: F811
    """EAGLE under T=2: the head runs on the driver from the final hidden states the last stage
    returns, its norm and LM head read from the checkpoint (the driver holds no model). Greedy
    outputs are plain decoding's; the head drafts from states the ranks all-reduced, so its
    proposals may differ from the single process's by rounding (acceptance is checked, not equated)."""
    import shutil

    from baton.common.checkpoint import load_checkpoint
    from baton.common.eagle import save_eagle

    from ..test_speculative import agreeing_eagle

    shutil.copytree(model_dir / "target", tmp_path / "target")
    save_eagle(agreeing_eagle(load_checkpoint(tmp_path / "target").model, steps=60), tmp_path / "target")
    plain = LLMEngine.from_checkpoint(tmp_path / "target", EngineConfig(num_kv_blocks=96, block_size=8))
    workload = _plain(plain.vocab_size, (LOOP,))
    want = tokens(drive(plain, workload))
    spec = SpeculativeConfig("eagle", 3, tree_width=2, tree_nodes=5)
    cfg = EngineConfig(
        num_kv_blocks=40, block_size=8, speculative=spec, scheduler=SchedulerConfig(max_num_batched_tokens=32)
    )
    with sharded(tmp_path / "target", cfg, "T2") as llm:
        got = tokens(drive(llm.engine, workload))
        check_really_sharded(llm.engine, "T2", weight_bytes(plain.model))
        stats = llm.engine.speculative.stats
    assert got == want
    assert stats.accepted > 0 and stats.accepted_by_depth[1] > 0, stats
