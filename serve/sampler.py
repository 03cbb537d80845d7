"""Turn one row of logits per sequence into the next token, with vLLM's sampling knobs.

The whole batch is sampled with tensor ops on the logits' own device: penalties, temperature and
truncation take per-row parameter tensors, and every branch is decided on the host from the
sampling parameters, never from tensor values, so one call waits for the device once (when the
tokens, the fallback flags and the logprobs come back together).

Each sequence is sampled with its own torch.Generator when it has a seed, so its tokens do not
depend on which other requests share the batch (a token is drawn by inverse CDF from one uniform
per row: see _draw). Logprobs are reported from the model's raw distribution (before penalties
and truncation), as vLLM does; a structured-output row's raw logits are first masked by its
grammar (serve/grammar.py), so a fallback to greedy stays inside the grammar too.

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

import numpy as np
import torch
from baton.kernels.argmax import first_max
from baton.serve.core.sequence import Sequence
from baton.serve.grammar import mask_logits
from baton.serve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
_F32_MAX = torch.finfo(torch.float32).max


@dataclass
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None  # sampled token + top-k alternatives


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits a sampler can use: NaN -> -inf (never chosen), +inf -> the largest float32."""
    return torch.nan_to_num(logits.float(), nan=-math.inf, posinf=_F32_MAX, neginf=-math.inf)


# --- host -> device --------------------------------------------------------------------------


def _on(device: torch.device, t: torch.Tensor) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queue: a plain copy to CUDA
    (torch.tensor(..., device="cuda") included) synchronizes the stream; pinned + non_blocking
    does not, and the caching host allocator keeps the pinned buffer until the copy is done."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _tensor(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _on(device, torch.tensor(data, dtype=dtype))


def _rows(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """t's rows at index (None: all of them, no copy)."""
    return t if index is None else t.index_select(0, index)


def _index(rows: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    return None if len(rows) == total else _tensor(rows, torch.long, device)


def _padded_ids(lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(lists), longest] token ids, padded with `vocab` (a column the caller drops). Checked
    here on the host: an id outside the vocabulary would be a device-side assert in a scatter."""
    lengths = np.fromiter((len(ids) for ids in lists), dtype=np.int64, count=len(lists))
    a = np.full((len(lists), max(int(lengths.max(initial=0)), 1)), vocab, dtype=np.int64)
    for i, ids in enumerate(lists):
        a[i, : len(ids)] = ids
    filled = np.arange(a.shape[1]) < lengths[:, None]
    if filled.any() and not (0 <= a[filled].min() and a[filled].max() < vocab):
        raise ValueError(f"token ids outside the vocabulary (0..{vocab - 1}) cannot be penalized")
    return _on(device, torch.from_numpy(a))


# --- penalties, temperature, truncation (batched) --------------------------------------------


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def _penalties(x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """x: [rows, vocab] float64 logits of these sequences, penalized (a new tensor). float64: in
    float32 a penalty of 1e-300 or 1e300 could round to 0 or inf, and 0 * inf = NaN; here the
    result may hold +-inf (the caller cleans it), never NaN."""
    rows, vocab = x.shape
    dev, params = x.device, [s.params for s in seqs]
    if any(p.repetition_penalty != 1.0 for p in params):  # CTRL-style, over prompt + output
        ids = _padded_ids(
            [s.token_ids if p.repetition_penalty != 1.0 else [] for s, p in zip(seqs, params)], vocab, dev
        )
        seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :vocab]
        rp = [float(p.repetition_penalty) for p in params]  # float(): an int may be past torch's int64
        rp = _tensor(rp, torch.float64, dev).unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if any(p.presence_penalty or p.frequency_penalty for p in params):  # OpenAI-style, over output
        ids = _padded_ids(
            [s.output_token_ids if p.presence_penalty or p.frequency_penalty else [] for s, p in zip(seqs, params)],
            vocab,
            dev,
        )
        counts = torch.zeros(rows, vocab + 1, dtype=torch.float64, device=dev)
        counts = counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float64, device=dev))[:, :vocab]
        freq = _tensor([float(p.frequency_penalty) for p in params], torch.float64, dev).unsqueeze(1)
        pres = _tensor([float(p.presence_penalty) for p in params], torch.float64, dev).unsqueeze(1)
        x = x - (freq * counts + pres * (counts > 0))
    return x


def _top_p_floor(values: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """values [rows, n] sorted descending and their probabilities: the smallest value top-p keeps
    (the smallest prefix whose mass reaches top_p; +inf top_p keeps everything)."""
    drop = probs.cumsum(-1) - probs >= top_p.unsqueeze(1)  # keep the token that crosses top_p
    drop[:, 0] = False  # a top_p under float32's range (1e-300) compares as 0, and 0 >= 0
    return values.masked_fill(drop, math.inf).amin(-1)


def _truncate(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x: [rows, vocab] temperature-scaled logits (or their log_softmax: all three knobs are
    shift-invariant). Per row: top-k, then top-p (nucleus), then min-p; a new tensor.

    Each knob comes down to a floor per row, and a token is kept when it is >= every floor: the
    k-th largest value; the value of the token whose cumulative mass crosses top_p; max + log(min_p).
    So tokens tied with a boundary token are kept with it, whatever order a sort put them in, on
    any device. The top token is above every floor: no row is left empty."""
    rows, vocab = x.shape
    dev = x.device
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = [float(p.top_p) if p.top_p < 1.0 else math.inf for p in params]  # +inf: off
    floor = torch.full((rows,), -math.inf, dtype=x.dtype, device=dev)
    with_k = [i for i in range(rows) if top_k[i]]
    if with_k:  # topk of the largest k asked for, not a sort of the vocabulary
        index = _index(with_k, rows, dev)
        sub = _rows(x, index)
        values = torch.topk(sub, max(top_k[i] for i in with_k)).values  # sorted, descending
        k = _tensor([top_k[i] for i in with_k], torch.long, dev).unsqueeze(1)
        kth = values.gather(1, k - 1).squeeze(1)
        f = kth
        if any(top_p[i] < math.inf for i in with_k):
            # top-p over what top-k kept: a softmax over the top values whose mass also counts the
            # tokens tied with the k-th value that topk left out (each equals the k-th value)
            kth_, peak = kth.unsqueeze(1), values[:, :1]
            top = torch.exp(values.masked_fill(values < kth_, -math.inf) - peak)
            left_out = (sub >= kth_).sum(-1, keepdim=True) - (values >= kth_).sum(-1, keepdim=True)
            probs = top / (top.sum(-1, keepdim=True) + left_out * torch.exp(kth_ - peak))
            cut = _tensor([top_p[i] for i in with_k], torch.float32, dev)
            f = torch.maximum(kth, _top_p_floor(values, probs, cut))
        floor = f if index is None else floor.index_copy(0, index, f)
    only_p = [i for i in range(rows) if not top_k[i] and top_p[i] < math.inf]
    if only_p:  # top-p alone needs the whole row sorted
        index = _index(only_p, rows, dev)
        values = torch.sort(_rows(x, index), dim=-1, descending=True).values
        cut = _tensor([top_p[i] for i in only_p], torch.float32, dev)
        f = _top_p_floor(values, torch.softmax(values, -1), cut)
        floor = f if index is None else floor.index_copy(0, index, f)
    if any(p.min_p > 0.0 for p in params):
        # p >= min_p * p_max, in log space: probabilities underflow, min_p may be 5e-324 (min_p = 0: -inf, off)
        log_min = _tensor([math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params], torch.float32, dev)
        floor = torch.maximum(floor, x.amax(-1) + log_min)
    if not (with_k or only_p or any(p.min_p > 0.0 for p in params)):
        return x
    return x.masked_fill(x < floor.unsqueeze(1), -math.inf)


@functools.cache
def _warn_fallback() -> None:
    log.warning(
        "a sampling distribution was not finite (NaN/inf logits from the model, or penalties left no "
        "finite logit): such rows are sampled greedily from the model's finite logits (logged once)"
    )


@dataclass
class _Distributions:
    """What the batch draws from. Rows are split on the host by their parameters."""

    greedy: list[int]  # rows that take the argmax
    sampled: list[int]  # rows drawn at random
    greedy_index: torch.Tensor | None  # the same rows on the device (None: every row)
    sampled_index: torch.Tensor | None
    greedy_tokens: torch.Tensor  # [len(greedy)] long
    probs: torch.Tensor | None  # [len(sampled), vocab] float32, each row finite and summing to 1
    mode: torch.Tensor | None  # [len(sampled)] long: a token with mass in each sampled row
    ok: torch.Tensor  # [rows] bool; False: the row's distribution was not finite, it is greedy on the raw logits


def _distributions(raw: torch.Tensor, seqs: list[Sequence]) -> _Distributions:
    """raw: finite_logits of the batch [len(seqs), vocab], on any device; all work stays there."""
    rows, _ = raw.shape
    dev = raw.device
    penalized = [i for i, s in enumerate(seqs) if _has_penalties(s.params)]
    pen, raw_arg_p = raw, None
    if penalized:
        p_index = _index(penalized, rows, dev)
        sub = _rows(raw, p_index)
        raw_arg_p = sub.argmax(-1)
        x = finite_logits(_penalties(sub.double(), [seqs[i] for i in penalized]))
        pen = x if p_index is None else raw.index_copy(0, p_index, x)
    pen_max, pen_arg = pen.max(-1)  # the first maximum, as argmax
    raw_arg = pen_arg  # the raw argmax: where no penalty applies, pen is raw
    if raw_arg_p is not None:
        raw_arg = raw_arg_p if p_index is None else raw_arg.index_copy(0, p_index, raw_arg_p)
    ok = torch.isfinite(pen_max)  # finite_logits: the max is finite or the row is all -inf

    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    g_index = _index(greedy, rows, dev) if greedy else None
    s_index = _index(sampled, rows, dev) if sampled else None
    greedy_tokens = pen_arg.new_empty(0)
    if greedy:
        greedy_tokens = torch.where(_rows(ok, g_index), _rows(pen_arg, g_index), _rows(raw_arg, g_index))
    probs = mode = None
    if sampled:
        params = [seqs[i].params for i in sampled]
        x, ok_s, peak = _rows(pen, s_index), _rows(ok, s_index), _rows(pen_max, s_index)
        # log_softmax(x / T) for any T >= SAMPLING_EPS: shifted to max 0 first, the quotients are
        # <= 0 (overflow only to -inf) and the top one is 0; T past float32 is its largest float
        shift = torch.where(ok_s, peak, 0.0).unsqueeze(1)
        temp = _tensor([min(float(p.temperature), _F32_MAX) for p in params], torch.float32, dev).unsqueeze(1)
        probs = torch.softmax(_truncate(torch.log_softmax((x - shift) / temp, -1), params), -1)
        total = probs.sum(-1)  # NaN or inf anywhere in the row makes it NaN or inf (probs are >= 0)
        ok_s = ok_s & (total > 0) & (total < math.inf)
        fallback = _rows(raw_arg, s_index)
        probs = torch.where(ok_s.unsqueeze(1), probs, torch.zeros_like(probs).scatter_(1, fallback.unsqueeze(1), 1.0))
        # a token each row surely has mass on: the top token survives truncation, the fallback is a one-hot
        mode = torch.where(ok_s, _rows(pen_arg, s_index), fallback)
        ok = ok_s if s_index is None else ok.index_copy(0, s_index, ok_s)
    return _Distributions(greedy, sampled, g_index, s_index, greedy_tokens, probs, mode, ok)


def _merge(d: _Distributions, greedy: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Per-row values of the greedy rows and of the sampled rows, back in batch order."""
    if not d.sampled:
        return greedy
    if not d.greedy:
        return sampled
    out = sampled.new_empty((len(d.greedy) + len(d.sampled), *sampled.shape[1:]))
    return out.index_copy_(0, d.greedy_index, greedy).index_copy_(0, d.sampled_index, sampled)


def target_distributions(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[len(seqs), vocab]: the distribution each row's token is drawn from (penalties,
    temperature, truncation, softmax; greedy rows a one-hot at the argmax). Always finite float32
    rows summing to 1: a row with nothing to sample from is greedy on the raw logits."""
    d = _distributions(finite_logits(logits), seqs)
    one_hot = torch.zeros(len(d.greedy), logits.shape[-1], dtype=torch.float32, device=logits.device)
    out = _merge(d, one_hot.scatter_(1, d.greedy_tokens.unsqueeze(1), 1.0), d.probs)
    if not bool(d.ok.all()):
        _warn_fallback()
    return out


def target_distribution(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row of target_distributions: speculative verification uses the very same distribution."""
    return target_distributions(logits.unsqueeze(0), [seq])[0]


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row [vocab], in place. May leave +-inf (a penalty of 1e-300 or 1e300 overflows float32), never NaN."""
    if _has_penalties(seq.params):
        logits.copy_(_penalties(logits.unsqueeze(0).double(), [seq])[0])
    return logits


def truncate(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row [vocab] of _truncate: top-k, top-p, min-p; the top token always survives."""
    return _truncate(logits.unsqueeze(0), [seq.params])[0]


# --- drawing and logprobs --------------------------------------------------------------------


def _draw(probs: torch.Tensor, mode: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One token per row of probs [rows, vocab], by inverse CDF: the first token whose cumulative
    mass (float64) passes u * total, u uniform in [0, 1).

    Unseeded rows take their u from one batched draw on the device. A seeded row takes its u from
    its own seq.generator, so its token depends on nothing else in the batch. Those generators are
    CPU generators (Sequence.make_generator), and stay so: speculative verification and the draft
    proposer draw from the same one on the CPU. So the u's are drawn where the generator lives,
    one scalar per seeded row, and copied to the device without a sync; the same seed then gives
    the same tokens on any device."""
    rows, vocab = probs.shape
    dev = probs.device
    seeded = [i for i, s in enumerate(seqs) if s.generator is not None]
    unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
    if not seeded:
        u = torch.rand(rows, dtype=torch.float64, device=dev)  # one batched draw
    else:
        draws = [
            torch.rand(1, dtype=torch.float64, generator=g, device=g.device)
            for g in (seqs[i].generator for i in seeded)
        ]
        if all(t.device.type == "cpu" for t in draws):
            mine = _on(dev, torch.cat(draws))  # one host -> device copy for all seeded rows
        else:
            mine = torch.cat([_on(dev, t) for t in draws])
        u = torch.empty(rows, dtype=torch.float64, device=dev).index_copy_(0, _tensor(seeded, torch.long, dev), mine)
        if unseeded:
            rest = torch.rand(len(unseeded), dtype=torch.float64, device=dev)  # one batched draw
            u.index_copy_(0, _tensor(unseeded, torch.long, dev), rest)
    cdf = probs.cumsum(-1, dtype=torch.float64)
    tokens = torch.searchsorted(cdf, (u.unsqueeze(1) * cdf[:, -1:]).contiguous(), right=True).squeeze(1)
    tokens = tokens.clamp_(max=vocab - 1)
    # A token of zero mass is never the answer: sequentially its cdf equals its predecessor's, but a
    # parallel scan may round a block boundary up by an ulp, and u * total may round to the total
    # (clamped above). Then the row takes `mode`, a token it has mass on (probability ~2**-53).
    return torch.where(probs.gather(1, tokens.unsqueeze(1)).squeeze(1) > 0, tokens, mode)


def _raw_logprobs(raw: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(torch.log_softmax(raw, -1), nan=-math.inf)  # NaN: an all -inf row


def _logprob_dicts(tokens: list[int], ks: list[int], chosen: list[float], top_v, top_i, width: int):
    """Host-side: {chosen token: logprob, then the row's top-k} for each row."""
    out = []
    for r, (token, k) in enumerate(zip(tokens, ks)):
        lp = {token: chosen[r]}
        lp.update({int(top_i[r * width + j]): top_v[r * width + j] for j in range(min(k, width))})
        out.append(lp)
    return out


def logprobs_of(logits: torch.Tensor, token: int, k: int | None) -> dict[int, float] | None:
    """Raw-model logprobs of the chosen token and the top-k alternatives, for one row [vocab]."""
    if k is None:
        return None
    raw = _raw_logprobs(finite_logits(logits))
    top = torch.topk(raw, min(k, raw.shape[-1]))
    return _logprob_dicts(
        [token], [k], [float(raw[token])], top.values.tolist(), top.indices.tolist(), top.values.numel()
    )[0]


def _to_host(*ts: torch.Tensor) -> list[list[float]]:
    """The tensors' values in one device -> host copy (as float64: exact for float32 and token ids)."""
    flat = torch.cat([t.reshape(-1).double() for t in ts]).tolist()
    out, at = [], 0
    for t in ts:
        out.append(flat[at : at + t.numel()])
        at += t.numel()
    return out


def _plain_greedy(seqs: list[Sequence]) -> bool:
    """Every row takes the argmax of its raw logits: no penalty, logprobs or grammar changes it."""
    return all(
        s.params.greedy
        and s.params.logprobs is None
        and (s.grammar is None or not s.grammar.restricts)  # thinking: unmasked until a budget forces
        and not _has_penalties(s.params)
        for s in seqs
    )


def _greedy_tokens(logits: torch.Tensor) -> list[int] | None:
    """The first maximum of each row, with one host copy and no float32 copy of the logits; None
    when some row's maximum is not finite (NaN, +-inf), which the full path cleans first. Where
    every maximum is finite, finite_logits changes nothing that argmax sees (NaN and -inf are
    below it, and there is no +inf), so the tokens are the full path's."""
    peak, arg = first_max(logits)  # on CPU one C++ pass (torch's max(-1) is a scalar loop there)
    host = torch.stack([arg.double(), peak.double()]).tolist()
    if not all(math.isfinite(v) for v in host[1]):
        return None
    return [int(t) for t in host[0]]


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
    """logits: [len(seqs), vocab], on any device (the work stays there)."""
    if not seqs:
        return []
    if _plain_greedy(seqs) and (ids := _greedy_tokens(logits)) is not None:  # the common serving case
        return [SampleResult(t, None) for t in ids]
    raw = finite_logits(logits)  # a new tensor: the grammar masks it in place
    mask_logits(raw, seqs)  # structured outputs (serve/grammar.py); nothing when no row is constrained
    rows, vocab = raw.shape
    dev = raw.device
    d = _distributions(raw, seqs)
    drawn = _draw(d.probs, d.mode, [seqs[i] for i in d.sampled]) if d.sampled else d.greedy_tokens
    tokens = _merge(d, d.greedy_tokens, drawn)
    wanting = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    extra: list[torch.Tensor] = []
    width = 0
    if wanting:
        index = _index(wanting, rows, dev)
        lp = _raw_logprobs(_rows(raw, index))
        width = min(max(seqs[i].params.logprobs for i in wanting), vocab)
        top = torch.topk(lp, width)
        extra = [lp.gather(1, _rows(tokens, index).unsqueeze(1)), top.values, top.indices]
    host = _to_host(tokens, d.ok, *extra)
    if not all(host[1]):
        _warn_fallback()
    ids = [int(t) for t in host[0]]
    results = [SampleResult(t, None) for t in ids]
    if wanting:
        ks = [seqs[i].params.logprobs for i in wanting]
        for i, lp in zip(wanting, _logprob_dicts([ids[i] for i in wanting], ks, host[2], host[3], host[4], width)):
            results[i].logprobs = lp
    return results


def sample_one(logits: torch.Tensor, seq: Sequence) -> SampleResult:
    """logits: [vocab] for one sequence."""
    return sample(logits.unsqueeze(0), [seq])[0]
