"""The engine's greedy outputs against HF generate and the reference decoder, in every mode."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from baton.common.checkpoint import load_checkpoint
from baton.common.model import greedy_generate
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.llm import LLM
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

from .conftest import BASE, FAMILIES, make_hf_checkpoint, run_staggered

LENGTHS = (3, 41, 17, 90, 6, 33)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_hf_generate_with_staggered_arrivals(tmp_path, family):
    hf, ckpt = make_hf_checkpoint(tmp_path, family)
    prompts = _prompts()
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            pad_token_id=0,
        )
        expected.append(out[0, len(p) :].tolist())
    engine = LLMEngine.from_checkpoint(
        ckpt, EngineConfig(num_kv_blocks=128, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    )
    assert run_staggered(engine, prompts, GREEDY) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


MODES = {
    "default": EngineConfig(num_kv_blocks=128, block_size=8),
    "no-prefix-cache": EngineConfig(num_kv_blocks=128, block_size=8, enable_prefix_caching=False),
    "no-chunked-prefill": EngineConfig(
        num_kv_blocks=128,
        block_size=8,
        scheduler=SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=128),
    ),
    "tiny-budget-chunks": EngineConfig(
        num_kv_blocks=128, block_size=4, scheduler=SchedulerConfig(max_num_batched_tokens=7)
    ),
    "preempt-recompute": EngineConfig(
        num_kv_blocks=18,
        block_size=8,
        scheduler=SchedulerConfig(max_num_batched_tokens=32, preemption_mode="recompute"),
    ),
    "preempt-swap": EngineConfig(
        num_kv_blocks=18, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=32, preemption_mode="swap")
    ),
}


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("modes"), "llama")[1]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_modes_give_identical_outputs(llama_ckpt, mode):
    model = load_checkpoint(llama_ckpt).model
    shared = _prompts(seed=1, lengths=(40,))[0]
    prompts = _prompts() + [shared + p for p in _prompts(seed=2, lengths=(5, 9, 21))]  # shared prefix
    expected = [greedy_generate(model, torch.tensor([p]), 24)[0].tolist() for p in prompts]
    engine = LLMEngine.from_checkpoint(llama_ckpt, MODES[mode])
    engine.runner.apply_block_ops = ops = mock.Mock(wraps=engine.runner.apply_block_ops)  # (BlockOps)
    assert run_staggered(engine, prompts, GREEDY, every=2) == expected
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.host_free) == bm.num_host_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    if mode.startswith("preempt"):
        assert engine.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    if mode == "preempt-swap":
        assert bm.num_host_blocks > 0
        swaps = [(c.args[0].swap_out, c.args[0].swap_in) for c in ops.call_args_list]
        assert all(any(s[i] for s in swaps) for i in (0, 1)), "no KV block was swapped out and in"
    if mode == "default":
        assert bm.prefix_hits == 2 * 40, "the 2nd and 3rd requests should find the shared 40-token prefix cached"


def test_abort_frees_everything(llama_ckpt):
    engine = LLMEngine.from_checkpoint(llama_ckpt, EngineConfig(num_kv_blocks=64, block_size=8))
    for i, p in enumerate(_prompts()):
        engine.add_request(str(i), p, SamplingParams(temperature=0.8, max_tokens=50, n=2, seed=i))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for i in range(len(LENGTHS)):
        out = engine.abort_request(str(i))
        assert out.finished and all(o.finish_reason in ("abort", "length", "stop") for o in out.outputs)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.abort_request("unknown") is None


def test_llm_offline_api_with_text(llama_dir):
    llm = LLM(llama_dir, EngineConfig(num_kv_blocks=64, block_size=8))
    outs = llm.generate(["The quick brown", "def f(x):"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    model = load_checkpoint(llama_dir).model
    tok = llm.engine.tokenizer
    for out, prompt in zip(outs, ["The quick brown", "def f(x):"]):
        ref = greedy_generate(model, torch.tensor([tok.encode(prompt)]), 12)[0].tolist()
        c = out.outputs[0]
        assert c.token_ids == ref and c.text == tok.decode(ref, skip_special_tokens=True)
        assert c.finish_reason == "length" and out.metrics.num_generated_tokens == 12
        assert out.metrics.ttft is not None and out.metrics.num_prompt_tokens == len(tok.encode(prompt))
