"""Turn one row of logits per sequence into the next token, with vLLM's sampling knobs.

Each sequence is sampled with its own torch.Generator when it has a seed, so its tokens do not
depend on which other requests share the batch. Logprobs are reported from the model's raw
distribution (before penalties and truncation), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.serve.sequence import Sequence


@dataclass
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None  # sampled token + top-k alternatives


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def truncate(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """top-k, then top-p (nucleus), then min-p, on temperature-scaled logits."""
    p = seq.params
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= p.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def target_distribution(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The distribution a token is drawn from: penalties, temperature, truncation, softmax.
    Greedy requests get a one-hot at the argmax. Speculative verification uses the same one."""
    logits = apply_penalties(logits.clone(), seq)
    if seq.params.greedy:
        return torch.zeros_like(logits).scatter_(0, torch.argmax(logits).view(1), 1.0)
    return torch.softmax(truncate(logits / seq.params.temperature, seq), -1)


def logprobs_of(logits: torch.Tensor, token: int, k: int | None) -> dict[int, float] | None:
    """Raw-model logprobs of the chosen token and the top-k alternatives."""
    if k is None:
        return None
    raw = torch.log_softmax(logits, -1)
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
    logits = logits.float().cpu()
    plain = [i for i, s in enumerate(seqs) if s.params.greedy and s.params.logprobs is None
             and s.params.repetition_penalty == 1.0 and not s.params.presence_penalty and not s.params.frequency_penalty]
    results: list[SampleResult | None] = [None] * len(seqs)
    if plain:
        for i, tok in zip(plain, logits[plain].argmax(-1).tolist()):
            results[i] = SampleResult(tok, None)
    for i, seq in enumerate(seqs):
        if results[i] is None:
            results[i] = sample_one(logits[i], seq)
    return results  # type: ignore[return-value]
