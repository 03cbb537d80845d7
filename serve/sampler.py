"""Turn one row of logits per sequence into the next token, with vLLM's sampling knobs.

Each sequence is sampled with its own torch.Generator when it has a seed, so its tokens do not
depend on which other requests share the batch. Logprobs are reported from the model's raw
distribution (before penalties and truncation), as vLLM does.

Every parameter SamplingParams.validate admits samples without NaN/inf: the model's NaN logits
are never chosen and +inf ones become the largest float, penalties are computed in float64,
temperature divides logits shifted so their max is 0, truncation works on log-probabilities and
always keeps the top token. A row left with nothing finite falls back to greedy, with a warning.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from baton.serve.sequence import Sequence

log = logging.getLogger(__name__)
_F32_MAX = torch.finfo(torch.float32).max


@dataclass
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None  # sampled token + top-k alternatives


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits a sampler can use: NaN -> -inf (never chosen), +inf -> the largest float32."""
    return torch.nan_to_num(logits.float(), nan=-math.inf, posinf=_F32_MAX, neginf=-math.inf)


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """In place. May leave +-inf (a penalty of 1e-300 or 1e300 overflows float32), never NaN."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
        vals, rp = logits[seen].double(), float(p.repetition_penalty)  # (an int may be past torch's int64)
        # in float32 the penalty itself could round to 0 or inf, and 0 * inf = NaN
        logits[seen] = torch.where(vals > 0, vals / rp, vals * rp).to(logits.dtype)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def truncate(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """top-k, then top-p (nucleus), then min-p, on temperature-scaled logits (or their log_softmax:
    all three are shift-invariant). The top token always survives, so the result is never empty."""
    p = seq.params
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs >= p.top_p  # keep the token that crosses top_p
        drop[0] = False  # a top_p under float32's range (1e-300) compares as 0, and 0 >= 0
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:  # p >= min_p * p_max, in log space: probabilities underflow, min_p may be 5e-324
        logits = logits.masked_fill(logits < logits.max() + math.log(p.min_p), float("-inf"))
    return logits


def _scaled_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) for finite-max logits and any temperature >= SAMPLING_EPS:
    shifted to max 0 first, the quotients are <= 0 (overflow only to -inf) and the top one is 0."""
    return torch.log_softmax((logits - logits.max()) / min(float(temperature), _F32_MAX), -1)


def _one_hot(logits: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(logits).scatter_(0, torch.argmax(logits).view(1), 1.0)


@functools.cache
def _warn_fallback() -> None:
    log.warning(
        "a sampling distribution was not finite (NaN/inf logits from the model, or penalties left no "
        "finite logit): such rows are sampled greedily from the model's finite logits (logged once)"
    )


def target_distribution(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The distribution a token is drawn from: penalties, temperature, truncation, softmax.
    Greedy requests get a one-hot at the argmax. Speculative verification uses the same one.
    Always a finite float32 vector summing to 1: a row with nothing to sample from is greedy."""
    raw = finite_logits(logits)
    penalized = finite_logits(apply_penalties(raw.clone(), seq))
    if torch.isfinite(penalized.max()):
        if seq.params.greedy:
            return _one_hot(penalized)
        probs = torch.softmax(truncate(_scaled_logprobs(penalized, seq.params.temperature), seq), -1)
        if torch.isfinite(probs).all() and probs.sum() > 0:
            return probs
    _warn_fallback()
    return _one_hot(raw)


def logprobs_of(logits: torch.Tensor, token: int, k: int | None) -> dict[int, float] | None:
    """Raw-model logprobs of the chosen token and the top-k alternatives."""
    if k is None:
        return None
    raw = torch.nan_to_num(torch.log_softmax(finite_logits(logits), -1), nan=-math.inf)  # NaN: an all -inf row
    lp = {token: float(raw[token])}
    if k:
        top = torch.topk(raw, k)
        lp.update({int(i): float(v) for v, i in zip(top.values, top.indices)})
    return lp


def sample_one(logits: torch.Tensor, seq: Sequence) -> SampleResult:
    """logits: [vocab] float32 for one sequence."""
    probs = target_distribution(logits, seq)
    if seq.params.greedy:
        token = int(torch.argmax(probs))
    else:
        token = int(torch.multinomial(probs, 1, generator=seq.generator))
    return SampleResult(token, logprobs_of(logits, token, seq.params.logprobs))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
    """logits: [len(seqs), vocab]. Greedy rows without penalties take one batched argmax."""
    logits = finite_logits(logits).cpu()
    plain = [
        i
        for i, s in enumerate(seqs)
        if s.params.greedy
        and s.params.logprobs is None
        and s.params.repetition_penalty == 1.0
        and not s.params.presence_penalty
        and not s.params.frequency_penalty
    ]
    results: list[SampleResult | None] = [None] * len(seqs)
    if plain:
        for i, tok in zip(plain, logits[plain].argmax(-1).tolist()):
            results[i] = SampleResult(tok, None)
    for i, seq in enumerate(seqs):
        if results[i] is None:
            results[i] = sample_one(logits[i], seq)
    return results  # type: ignore[return-value]
