"""The 2025-26 families served: greedy tokens equal transformers' generate, in every engine mode.

One random-weight model per family, written by transformers itself with odd configs (GQA/MQA, an odd
vocabulary, tied and untied heads, mixed sliding and full layers, few and many experts); its norms,
biases and sinks are moved off their initial values so that each of them changes the logits. Each
family runs once per mode: prefix caching (a shared 40-token prefix), chunked prefill on a tiny
budget, and forced preemption by recompute and by swap.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from baton.common.checkpoint import load_checkpoint, save_model
from baton.common.hf import import_hf
from baton.common.tokenizer import train_bpe
from baton.serve.core.structured import StructuredOutputs
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

from .conftest import TEXT, run_staggered

BASE = dict(
    vocab_size=301,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    initializer_range=0.1,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
SLIDING3 = ["sliding_attention", "full_attention", "sliding_attention"]
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)),
    "qwen3-mqa-tied-sliding": (
        transformers.Qwen3Config,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=1,
            head_dim=24,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=7,
            layer_types=SLIDING3,
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
    "gemma3_text": (
        transformers.Gemma3TextConfig,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=7,
            layer_types=SLIDING3,
            query_pre_attn_scalar=24,
            final_logit_softcapping=5.0,
        ),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=7,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            attn_implementation="eager",  # (transformers' SDPA path would drop the soft-capping)
        ),
    ),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=7,
            attn_implementation="eager",
        ),
    ),
    "olmo2": (transformers.Olmo2Config, dict(num_hidden_layers=2, num_key_value_heads=2)),
}
MODES = {
    "prefix-cache": EngineConfig(num_kv_blocks=128, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=64)),
    "tiny-chunks": EngineConfig(num_kv_blocks=128, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=12)),
    "preempt-recompute": EngineConfig(
        num_kv_blocks=18,
        block_size=8,
        scheduler=SchedulerConfig(max_num_batched_tokens=32, preemption_mode="recompute"),
    ),
    "preempt-swap": EngineConfig(
        num_kv_blocks=18, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=32, preemption_mode="swap")
    ),
}
MAX_TOKENS = 16


def make_family_checkpoint(tmp_path, family: str, seed: int = 0):
    """(transformers model, Baton checkpoint) of a family, every 1-D weight (norms, biases, sinks) moved."""
    cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cls(**{**BASE, **extra})).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path / f"hf-{family}")
    return hf, import_hf(tmp_path / f"hf-{family}", tmp_path / f"baton-{family}")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, BASE["vocab_size"], (40,), generator=g).tolist()
    own = [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in (3, 29, 11, 50)]
    return own + [shared + p for p in own[:3]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    hf, ckpt = make_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    expected = []
    for p in prompts():
        ids = torch.tensor([p])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        expected.append(out[0, len(p) :].tolist())
    return request.param, ckpt, expected


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_equals_transformers_in_every_mode(family, mode):
    name, ckpt, expected = family
    engine = LLMEngine.from_checkpoint(ckpt, MODES[mode])
    got = run_staggered(engine, prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert got == expected, f"{name} in {mode}"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "every block is back in the pool"
    if mode.startswith("preempt"):
        assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    if mode == "prefix-cache":
        assert bm.prefix_hits > 0, "the shared 40-token prefix was meant to be found in the cache"


def test_ngram_speculation_gives_transformers_tokens(family):
    """Proposals verified in one pass (the n-gram proposer needs no draft model of the family)."""
    name, ckpt, expected = family
    cfg = EngineConfig(num_kv_blocks=128, block_size=8, speculative=SpeculativeConfig("ngram", 3))
    engine = LLMEngine.from_checkpoint(ckpt, cfg)
    got = run_staggered(engine, prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert got == expected, name


REGEX = r"(yes|no), [0-9]{2} [a-z]{1,6}\."


def test_structured_output_follows_the_regex(family, tmp_path):
    """xgrammar's mask over each family's logits (soft-capped, sink-normalised alike): sampled text fits."""
    name, ckpt, _ = family
    tok = train_bpe([TEXT], vocab_size=BASE["vocab_size"])
    model = load_checkpoint(ckpt).model
    model.config.eos_token_id = tok.eos_token_id
    save_model(tmp_path / "with-tok", model, tokenizer=tok)
    engine = LLMEngine.from_checkpoint(tmp_path / "with-tok", EngineConfig(num_kv_blocks=64, block_size=8))
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=48, structured=StructuredOutputs(regex=REGEX))
        engine.add_request(str(seed), "The quick brown fox", params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0]
    assert len(done) == 3
    for c in done.values():
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), (name, c.text)
