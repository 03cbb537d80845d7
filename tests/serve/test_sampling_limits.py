"""Extreme sampling parameters: each is refused by validate naming its field, or it samples a valid
token from a finite distribution, whatever the model's logits hold (-inf, NaN, +inf).

The accept/refuse decisions are checked against a domain written out here independently, so a
validate that refused everything (or nothing) fails too."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampler import sample, target_distribution
from baton.serve.sampling_params import SamplingParams
from baton.serve.speculative import SpeculativeConfig

I32, I64 = 2**31 - 1, 2**63 - 1
VOCAB = 64
EXTREMES = [
    0,
    0.0,
    -0.0,
    1,
    1e-300,
    5e-324,
    1e300,
    1.7976931348623157e308,
    math.nan,
    math.inf,
    -math.inf,
    -1,
    -1e-300,
    -1e300,
    0.5,
    1.5,
    2,
    -I64 - 1,
    I64,
    2**64,
    10**400,
    True,
    None,
    "1",
]


def _finite(v) -> bool:
    """A real number within float's range (int/float comparison is exact; NaN compares False)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= sys.float_info.max


def _int(v) -> bool:
    return type(v) is int


DOMAIN = {  # field -> is the value admitted (the documented ranges, written independently of validate)
    "n": lambda v: _int(v) and 1 <= v <= I32,
    "max_tokens": lambda v: _int(v) and 1 <= v <= I32,
    "top_k": lambda v: _int(v) and (v in (-1, 0) or 1 <= v <= I32),
    "logprobs": lambda v: v is None or _int(v) and 0 <= v <= 20,
    "seed": lambda v: v is None or _int(v) and -I64 - 1 <= v <= I64,
    "temperature": lambda v: _finite(v) and v >= 0,
    "top_p": lambda v: _finite(v) and 0 < v <= 1,
    "min_p": lambda v: _finite(v) and 0 <= v <= 1,
    "repetition_penalty": lambda v: _finite(v) and v > 0,
    "presence_penalty": lambda v: _finite(v) and -2 <= v <= 2,
    "frequency_penalty": lambda v: _finite(v) and -2 <= v <= 2,
}


def _logits() -> torch.Tensor:
    """Rows a model can produce: ordinary, with -inf entries, one NaN, +inf, huge, all NaN, all -inf."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(7, VOCAB, generator=g) * 4
    rows[1, ::2] = -math.inf
    rows[2, 5] = math.nan
    rows[3, 9] = math.inf
    rows[4] = torch.finfo(torch.float32).max * torch.sign(rows[4])
    rows[5] = math.nan
    rows[6] = -math.inf
    return rows


def _seqs(params: SamplingParams, n: int) -> list[Sequence]:
    seqs = []
    for i in range(n):
        s = Sequence(i, "r", i, [1, 2, 3, 9, 5], params)
        s.token_ids += [5, 5, 7, 0, 9]  # output tokens: penalties act on them, and on the prompt
        s.make_generator()
        seqs.append(s)
    return seqs


def _check_samples(params: SamplingParams) -> None:
    logits = _logits()
    seqs = _seqs(params, len(logits))
    for r in sample(logits, seqs):
        assert isinstance(r.token_id, int) and 0 <= r.token_id < VOCAB
        if r.logprobs is not None:
            assert all(not math.isnan(v) and v <= 0 for v in r.logprobs.values()), r.logprobs
    for row, seq in zip(logits, seqs):
        p = target_distribution(row, seq)
        assert p.shape == (VOCAB,) and torch.isfinite(p).all() and (p >= 0).all()
        assert abs(float(p.sum()) - 1) < 1e-5


@pytest.mark.parametrize("field", list(DOMAIN))
def test_every_extreme_is_refused_by_name_or_samples_validly(field):
    admitted = refused = 0
    for value in EXTREMES:
        params = SamplingParams(**{field: value})
        if DOMAIN[field](value):
            params.validate(VOCAB)
            _check_samples(params)
            admitted += 1
        else:
            with pytest.raises(ValueError, match=rf"^{field} must"):
                params.validate(VOCAB)
            refused += 1
    assert admitted and refused


@pytest.mark.parametrize(
    "values",
    [
        dict(temperature=1e-300, top_p=5e-324, min_p=5e-324, repetition_penalty=1e300),
        dict(
            temperature=1e300,
            top_k=I32,
            presence_penalty=-2,
            frequency_penalty=2,
            repetition_penalty=5e-324,
            logprobs=20,
            seed=-I64 - 1,
        ),
        dict(temperature=1e-5, top_p=1e-300, min_p=1.0, seed=I64, logprobs=0),
    ],
)
def test_extremes_combined(values):
    params = SamplingParams(**values)
    params.validate(VOCAB)
    _check_samples(params)


def test_stop_token_ids_must_be_real_ids():
    for bad in ([-1], [VOCAB], [True], [1.0], [2**64]):
        with pytest.raises(ValueError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=bad).validate(VOCAB)
    SamplingParams(stop_token_ids=[0, VOCAB - 1]).validate(VOCAB)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 9.99e-6])
def test_temperature_below_eps_is_exactly_the_argmax(temperature):
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(1))
    want = [int(torch.argmax(row)) for row in logits]
    for logprobs in (None, 2):  # the batched greedy path, and the per-row one
        params = SamplingParams(temperature=temperature, logprobs=logprobs)
        assert params.greedy
        assert [r.token_id for r in sample(logits, _seqs(params, 32))] == want
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("knob", [dict(top_p=1e-300), dict(top_p=5e-324), dict(min_p=1.0), dict(top_k=1)])
def test_the_tightest_truncation_keeps_only_the_top_token(knob):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    logits[::3] = -math.inf
    p = target_distribution(logits, _seqs(SamplingParams(temperature=1.0, **knob), 1)[0])
    assert p.tolist() == torch.nn.functional.one_hot(torch.argmax(logits), VOCAB).float().tolist()


def test_huge_temperature_is_uniform_over_the_finite_logits():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 50
    logits[:16] = -math.inf
    p = target_distribution(logits, _seqs(SamplingParams(temperature=1e300), 1)[0])
    assert (p[:16] == 0).all() and torch.allclose(p[16:], torch.full((VOCAB - 16,), 1 / (VOCAB - 16)))


@pytest.mark.parametrize("seed", [I64, -I64 - 1, -1])
def test_int64_edge_seeds_are_reproducible(seed):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=1.0, seed=seed)
    params.validate(VOCAB)

    def draws(index: int) -> list[int]:
        s = Sequence(0, "r", index, [1], params)
        s.make_generator()
        return [sample(logits.unsqueeze(0), [s])[0].token_id for _ in range(40)]

    assert draws(0) == draws(0) and draws(1) == draws(1)  # index 1: seed + 1 may pass 2**63
    assert draws(0) != draws(1)


@pytest.fixture(scope="module")
def draft_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("seeds")
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.1,
        max_position_embeddings=128,
    )
    save_model(d / "target", build_model(ModelConfig(**cfg), seed=0))
    save_model(d / "draft", build_model(ModelConfig(**cfg), seed=1))
    return d


@pytest.mark.parametrize("seed", [I64, -I64 - 1])
def test_draft_speculation_with_int64_edge_seeds(draft_models, seed):
    """The draft's generator is seeded from seed * 7919 + ...: it must not overflow manual_seed."""
    spec = SpeculativeConfig("draft", 3, draft_model=str(draft_models / "draft"))

    def run() -> list[list[int]]:
        engine = LLMEngine.from_checkpoint(
            draft_models / "target", EngineConfig(num_kv_blocks=32, block_size=8, speculative=spec)
        )
        engine.add_request(
            "r", [1, 2, 3, 4], SamplingParams(temperature=1.0, n=2, max_tokens=12, seed=seed, ignore_eos=True)
        )
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens = [o.token_ids for o in out.outputs]
        assert engine.speculative.stats.proposed > 0
        return tokens

    first = run()
    assert first == run() and all(len(t) == 12 for t in first)
