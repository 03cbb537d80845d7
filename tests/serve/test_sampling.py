"""Sampler knobs against naive formulas; seeded sampling; n > 1 with copy-on-write."""

from __future__ import annotations

import math

import pytest
import torch
from baton.kernels import argmax
from baton.kernels.cpu_extension import cpu_kernels
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampler import apply_penalties, sample, target_distribution, target_distributions, truncate
from baton.serve.sampling_params import SamplingParams

from ..system import require
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


def _reference_distribution(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The sampling distribution of one row, written out per token in float64 (no sampler code)."""
    p, vocab = seq.params, row.numel()
    x = [-math.inf if math.isnan(v) else min(v, 3.4028234663852886e38) for v in row.double().tolist()]
    if p.repetition_penalty != 1.0:
        for t in set(seq.token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(seq.output_token_ids):
        c = seq.output_token_ids.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    x = torch.tensor(x, dtype=torch.float64)
    if p.greedy:
        return torch.nn.functional.one_hot(torch.argmax(x), vocab).double()
    logp = torch.log_softmax(x / p.temperature, -1)
    # top-k and top-p keep every token tied with their boundary token
    keep = [True] * vocab
    order = sorted(range(vocab), key=lambda t: -logp[t].item())
    if 0 < p.top_k < vocab:
        kth = logp[order[p.top_k - 1]].item()
        keep = [logp[t].item() >= kth for t in range(vocab)]
    if p.top_p < 1.0:
        kept_mass = sum(math.exp(logp[t]) for t in range(vocab) if keep[t])
        cum = 0.0
        for t in (t for t in order if keep[t]):
            cum += math.exp(logp[t]) / kept_mass
            if cum >= p.top_p:  # the token that crosses top_p: nothing below it is kept
                keep = [k and logp[u].item() >= logp[t].item() for u, k in enumerate(keep)]
                break
    if p.min_p > 0.0:
        top = math.exp(logp.max())
        keep = [k and math.exp(logp[t]) >= p.min_p * top for t, k in enumerate(keep)]
    return torch.softmax(logp.masked_fill(~torch.tensor(keep), -math.inf), -1)


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5, logprobs=0),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(
        temperature=0.9,
        top_k=20,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logprobs=5,
    ),
    SamplingParams(temperature=1.5, top_k=40, top_p=0.95, seed=123),
    SamplingParams(temperature=1.0, frequency_penalty=-2.0, presence_penalty=2.0, seed=7),
    SamplingParams(temperature=1e-6, top_k=3),  # below SAMPLING_EPS: greedy
    SamplingParams(temperature=1.0, top_k=2, top_p=0.5),  # ties (_mixed_batch): 1 token, then 45 tied
    # top_p under float32's range keeps the top token, after penalties: the raw argmax is penalized
    SamplingParams(temperature=1.0, top_p=1e-300, repetition_penalty=100.0),
]


def _mixed_batch(vocab=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIXED), vocab, generator=g) * 3
    logits[2, ::7] = -math.inf
    logits[4, 11] = math.nan
    # one token, then 45 tied below it, more than topk(40) lists: with all 45 its mass is 42/87 < top_p
    logits[10] = -20.0
    logits[10, 50:95] = 0.0
    logits[10, 3] = math.log(42)
    seqs = []
    for i, params in enumerate(MIXED):
        prompt = torch.randint(0, vocab, (12,), generator=g).tolist()
        output = torch.randint(0, vocab, (6,), generator=g).tolist() + [int(torch.argmax(logits[i]))] * 2
        s = Sequence(i, "r", 0, prompt, params)
        s.token_ids += output
        s.make_generator()
        seqs.append(s)
    return logits, seqs


def test_batched_sampling_matches_a_per_row_reference():
    logits, seqs = _mixed_batch()
    want = torch.stack([_reference_distribution(row, s) for row, s in zip(logits, seqs)])
    got = target_distributions(logits, seqs)
    assert got.dtype == torch.float32 and got.shape == want.shape
    for i, s in enumerate(seqs):
        assert ((got[i] > 0) == (want[i] > 0)).all(), (i, s.params)  # the same tokens survive
        assert torch.allclose(got[i].double(), want[i], atol=1e-6, rtol=1e-4), (i, s.params)
        alone = target_distribution(logits[i], s)  # the single-row path (speculative verification)
        assert torch.allclose(alone, got[i], atol=1e-7, rtol=1e-6) and ((alone > 0) == (got[i] > 0)).all()
    results = sample(logits, seqs)
    for i, (r, s) in enumerate(zip(results, seqs)):
        if s.params.greedy:
            assert r.token_id == int(torch.argmax(want[i])), i
        assert want[i][r.token_id] > 0, (i, r.token_id)  # never a token the distribution excludes
        if s.params.logprobs is None:
            assert r.logprobs is None
            continue
        raw = torch.log_softmax(torch.nan_to_num(logits[i].double(), nan=-math.inf), -1)
        top = set(torch.topk(raw, s.params.logprobs).indices.tolist())
        assert set(r.logprobs) == top | {r.token_id}, i
        for t, v in r.logprobs.items():
            assert math.isclose(v, raw[t].item(), rel_tol=1e-5, abs_tol=1e-5), (i, t)


def test_a_seeded_row_draws_the_same_tokens_whatever_the_batch():
    logits, seqs = _mixed_batch()
    seeded = 7  # temperature 1.5, top_k 40, top_p 0.95, seed 123

    def tokens(order: list[int], steps: int = 40) -> list[int]:
        fresh = []
        for i in order:  # new sequences: each seeded one starts its generator afresh
            s = Sequence(i, "r", 0, seqs[i].prompt_token_ids, seqs[i].params)
            s.token_ids = list(seqs[i].token_ids)
            s.make_generator()
            fresh.append(s)
        rows = logits[order]
        at = order.index(seeded)
        return [sample(rows, fresh)[at].token_id for _ in range(steps)]

    alone = tokens([seeded])
    assert len(set(alone)) > 1  # it does sample
    assert tokens(list(range(len(MIXED)))) == alone
    assert tokens([9, 8, seeded, 3, 2]) == alone
    assert tokens([4, 5, 6, 0, 1, seeded]) == alone


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


@pytest.mark.parametrize("path", ["c++", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_rows_take_the_first_maximum_of_the_cleaned_logits(dtype, path, monkeypatch):
    """All-greedy batches take a fast path (the first maximum, one host copy: C++ on CPU once the
    serving kernels are loaded, else torch's max); rows whose maximum is not finite go through the
    full path. Either way: the first maximum after NaN -> -inf, +inf -> max."""
    if path == "torch":
        monkeypatch.setattr(argmax, "loaded_cpu_kernels", lambda *t: None)
    else:
        require("c++")
        assert cpu_kernels() is not None
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(8, 64, generator=g) * 3).to(dtype)
    logits[1, [4, 9, 30]] = logits[1].max() + 1  # a three-way tie: the first wins
    logits[2, 7] = math.nan
    logits[3, [5, 40]] = math.inf  # two +inf: the first
    logits[4] = -math.inf
    logits[4, 50] = 0.0
    logits[5, ::2] = -math.inf

    def expected(row: torch.Tensor) -> int:
        x = [-math.inf if math.isnan(v) else min(v, 3.4028234663852886e38) for v in row.double().tolist()]
        return x.index(max(x))

    want = [expected(row) for row in logits]
    plain = [_seq(SamplingParams(temperature=0)) for _ in range(8)]
    assert [r.token_id for r in sample(logits, plain)] == want
    finite = [0, 1, 4, 5, 6, 7]  # only finite maxima: the whole batch on the fast path
    assert [r.token_id for r in sample(logits[finite], plain[:6])] == [want[i] for i in finite]
    with_lp = [_seq(SamplingParams(temperature=0, logprobs=1)) for _ in range(8)]  # the full path
    assert [r.token_id for r in sample(logits, with_lp)] == want
