"""Sampler knobs against naive formulas; seeded sampling; n > 1 with copy-on-write."""

from __future__ import annotations

import math

import pytest
import torch

from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampler import apply_penalties, sample, truncate
from baton.serve.sampling_params import SamplingParams
from baton.serve.sequence import Sequence

from .conftest import BASE, make_hf_checkpoint


def _seq(params, prompt=(1, 2, 3), output=()):
    s = Sequence(0, "r", 0, list(prompt), params)
    s.token_ids += list(output)
    s.make_generator()
    return s


def test_top_k_top_p_min_p_against_naive():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    kept = lambda out: sorted(i for i, v in enumerate(out.tolist()) if v != -math.inf)  # noqa: E731
    assert kept(truncate(logits.clone(), _seq(SamplingParams(top_k=2)))) == [0, 5]
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True).tolist()
    for top_p in (0.3, 0.6, 0.9, 0.99):
        expected, cum = [], 0.0
        for i in order:  # smallest set whose mass reaches top_p
            expected.append(i)
            cum += probs[i].item()
            if cum >= top_p:
                break
        assert kept(truncate(logits.clone(), _seq(SamplingParams(top_p=top_p)))) == sorted(expected), top_p
    for min_p in (0.1, 0.3, 0.5):
        expected = [i for i in range(6) if probs[i] >= min_p * probs.max()]
        assert kept(truncate(logits.clone(), _seq(SamplingParams(min_p=min_p)))) == expected


def test_penalties_against_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0])
    out = apply_penalties(logits.clone(), _seq(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1]))
    assert out.tolist() == [1.0, -2.0, 0.5, 1.0]
    out = apply_penalties(
        logits.clone(), _seq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[3], output=[2, 2, 0])
    )
    assert out.tolist() == [2.0 - 0.5 - 0.25, -1.0, 0.5 - 0.5 - 0.5, 1.0]  # prompt token 3 untouched


def test_sampling_follows_the_distribution_and_logprobs_are_raw():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.0 + 1e-12]))
    seq = _seq(SamplingParams(temperature=1.0, seed=7, logprobs=2))
    counts = torch.zeros(4)
    for _ in range(3000):
        r = sample(logits.unsqueeze(0), [seq])[0]
        counts[r.token_id] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.03)
    assert set(r.logprobs) >= {0, 1} and math.isclose(r.logprobs[0], math.log(0.5), rel_tol=1e-5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("sampling"), "llama")[1]


def _generate(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
    return done


def test_seeded_sampling_is_reproducible_and_independent_of_batch(ckpt):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=30, seed=1234, ignore_eos=True)
    prompt = list(range(5, 25))
    alone = _generate(
        LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=64, block_size=8)), [("a", prompt, params)]
    )
    others = [
        (f"o{i}", list(range(i, i + 7 * i + 3)), SamplingParams(temperature=1.0, max_tokens=20 + i, seed=i))
        for i in range(1, 6)
    ]
    crowded = _generate(
        LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=64, block_size=8)),
        others[:3] + [("a", prompt, params)] + others[3:],
    )
    assert alone["a"] == crowded["a"]
    different = _generate(
        LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=64, block_size=8)),
        [("a", prompt, SamplingParams(**{**params.__dict__, "seed": 99}))],
    )
    assert different["a"] != alone["a"]


def test_n_samples_share_prompt_blocks_copy_on_write(ckpt):
    """Sample i of an n=3 request equals a lone request seeded seed+i: the forks' KV stay intact."""
    prompt = list(range(3, 3 + 21))  # 21 tokens: the last prompt block is partly filled and shared
    params = SamplingParams(temperature=1.0, n=3, max_tokens=16, seed=50, ignore_eos=True)
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=64, block_size=8))
    forked = _generate(engine, [("n3", prompt, params)])["n3"]
    assert engine.block_manager.num_free_blocks == 64
    singles = [
        _generate(
            LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=64, block_size=8)),
            [("s", prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=50 + i, ignore_eos=True))],
        )["s"][0]
        for i in range(3)
    ]
    assert forked == singles
    assert len({tuple(s) for s in forked}) == 3


def test_copy_on_write_happens_and_shares_blocks(ckpt):
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=64, block_size=8))
    engine.add_request("n4", list(range(3, 24)), SamplingParams(temperature=1.0, n=4, max_tokens=3, seed=1))
    engine.step()  # prefill 21 tokens (3 blocks) and fork
    used_after_fork = engine.block_manager.num_used_blocks
    assert used_after_fork == 3, "forks must share the prompt's blocks"
    engine.step()  # each fork writes into the shared partial block: 3 of 4 copy it
    assert engine.block_manager.num_used_blocks == 3 + 3


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "prompt is empty"),
        (list(range(300)), SamplingParams(), "prompt has 300 tokens; the model's context is 256"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
        ([1, 2], SamplingParams(temperature=-0.1), "temperature must be >= 0"),
        ([1, 2], SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        ([1, 2], SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
        ([1, 2], SamplingParams(stop_token_ids=[BASE["vocab_size"]]), "stop_token_ids contains 320"),
        ([1, 999], SamplingParams(), "prompt token ids must be integers"),
        ([1, 2], SamplingParams(n=0), "n must be an integer >= 1"),
        ([1, 2], SamplingParams(logprobs=50), "logprobs must be in 0..20"),
    ],
)
def test_bad_requests_fail_before_scheduling(ckpt, prompt, params, message):
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=64, block_size=8))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_work()


def test_kv_cache_too_small_for_one_sequence_is_rejected(ckpt):
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=2, block_size=8))
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        engine.add_request("big", list(range(20)), SamplingParams(max_tokens=10))
