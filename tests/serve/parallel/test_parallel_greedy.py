"""Sharded greedy decoding equals the single-process engine and HF transformers, token for token,
for every model family and layout: T=2, P=2, T=2 x P=2 (and Mixtral's experts tensor- or
expert-parallel), with requests arriving while others decode and prefills chunked.

The checkpoints are chosen to reach the sharding's corner cases: an odd vocabulary (the padded
vocab-parallel embedding and LM head), random biases on q/k/v and on the row-parallel o_proj
(added on one rank only), tied embeddings split across pipeline stages, one KV head for two
tensor ranks (replicated), sliding windows shorter than the sequences (on every layer, and on
some layers only), routed experts."""

from __future__ import annotations

import pytest
from baton.common.checkpoint import read_config, weight_files
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.parallel.config import ParallelConfig
from baton.serve.parallel.loader import weight_bytes
from baton.serve.parallel.shard import ExpertParallelMoE
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from safetensors import safe_open

from ..conftest import make_hf_checkpoint, run_staggered
from .conftest import check_really_sharded, hf_greedy, random_prompts, sharded

NEW_TOKENS = 16
LENGTHS = (3, 41, 17, 30, 6)
CASES = {
    # GQA 4/2; vocab 101 does not divide by 2; o_proj carries a (random) bias: row-parallel, rank 0 adds it.
    "llama": ("llama", {"vocab_size": 101, "num_hidden_layers": 4, "attention_bias": True}),
    # q/k/v biases; tied embeddings (a last stage without the embedding reads its tensor for the head);
    # MQA: kv=1 < T=2, replicated; per-layer windows: layers 0-1 full, 2-3 slide over 12 (a stage each at P=2).
    "qwen2": (
        "qwen2",
        {
            "vocab_size": 203,
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "use_sliding_window": True,
            "sliding_window": 12,
            "max_window_layers": 2,
        },
    ),
    # every layer slides over 12 tokens (the engine evicts outside the window); sequences reach 57.
    "mistral": ("mistral", {"num_hidden_layers": 4}),
    # 4 experts, top-2. (P=2 alone does not touch the MoE block: T=2 and T=2 x P=2 cover both modes.)
    "mixtral": ("mixtral", {"num_hidden_layers": 4}),
}
DENSE_RUNS = [("T2", "tensor"), ("P2", "tensor"), ("T2xP2", "tensor")]
RUNS = {  # case -> [(layout, moe_parallel)]
    "llama": DENSE_RUNS,
    "qwen2": DENSE_RUNS,
    "mistral": DENSE_RUNS,
    "mixtral": [("T2", "tensor"), ("T2xP2", "tensor"), ("T2", "expert"), ("T2xP2", "expert")],
}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _config(moe: str = "tensor") -> EngineConfig:
    return EngineConfig(
        num_kv_blocks=64,
        block_size=8,
        scheduler=SchedulerConfig(max_num_batched_tokens=24),  # the 30/41-token prompts are chunked
        parallel=ParallelConfig(moe_parallel=moe),
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_greedy_equals_single_process_and_hf(tmp_path, case):
    family, overrides = CASES[case]
    hf, ckpt = make_hf_checkpoint(tmp_path, family, **overrides)
    cfg = hf.config
    if cfg.tie_word_embeddings:  # the checkpoint really stores the embedding once
        names = {k for f in weight_files(ckpt) for k in safe_open(f, framework="pt").keys()}
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    if case == "qwen2":
        assert read_config(ckpt).layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    prompts = random_prompts(cfg.vocab_size, LENGTHS)
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    single = LLMEngine.from_checkpoint(ckpt, _config())
    assert run_staggered(single, prompts, GREEDY, every=2) == expected
    whole = weight_bytes(single.model)
    for layout, moe in RUNS[case]:
        with sharded(ckpt, _config(moe), layout) as llm:
            got = run_staggered(llm.engine, prompts, GREEDY, every=2)
            runner = check_really_sharded(llm.engine, layout, whole)
            if moe == "expert":
                layer = runner.local.model.model.layers[runner.local.layer_ids[0]]
                assert isinstance(layer.block_sparse_moe, ExpertParallelMoE)
                assert list(layer.block_sparse_moe.local_experts) == [0, 1]  # the driver's half of 4
        assert got == expected, f"{case} at {layout} (moe {moe})"
