"""Engine outputs as OpenAI response bodies and stream chunks (completions and chat).

Choice i of prompt p is index p * n + i, as OpenAI numbers a batched completions call. Logprobs
are the raw model's (before temperature and penalties), as the engine reports them; the chosen
token is always among a position's top_logprobs. JSON has no -inf: a token a grammar masks out
(structured outputs) is sent with vLLM's -9999.0.
"""

from __future__ import annotations

from baton.common.tokenizer import Tokenizer
from baton.serve.outputs import CompletionOutput, RequestOutput

TokenLogprobs = dict[int, float]
MASKED_LOGPROB = -9999.0  # vLLM's stand-in for -inf


def _piece(tok: Tokenizer | None, t: int) -> str:
    """A token's text; without a tokenizer vLLM's "token_id:<id>" form."""
    return f"token_id:{t}" if tok is None else tok.decode([t])


def completion_logprobs(
    tok: Tokenizer, ids: list[int], lps: list[TokenLogprobs | None], offset: int = 0, k: int | None = None
) -> dict:
    """Completions' logprobs object; a None entry (the first prompt token under echo) has no logprob."""
    tokens = [_piece(tok, t) for t in ids]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else lp[t] for t, lp in zip(ids, lps)],
        "top_logprobs": [None if lp is None else _top(tok, t, lp, k) for t, lp in zip(ids, lps)],
        "text_offset": offsets,
    }


def _top(tok: Tokenizer, chosen: int, lp: TokenLogprobs, k: int | None) -> dict[str, float]:
    """The chosen token and the k most likely (the engine's dict holds exactly those), keyed by text."""
    ranked = sorted(lp.items(), key=lambda kv: -kv[1])
    out = {_piece(tok, chosen): lp[chosen]}
    for t, v in ranked[:k] if k is not None else ranked:
        out.setdefault(_piece(tok, t), v)  # pieces that decode alike share a key: the chosen, then the likelier
    return out


def chat_logprobs(tok: Tokenizer, ids: list[int], lps: list[TokenLogprobs], k: int) -> dict:
    """Chat's logprobs object: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def entry(t: int, v: float) -> dict:
        s = _piece(tok, t)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    content = []
    for t, lp in zip(ids, lps):
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        content.append({**entry(t, lp[t]), "top_logprobs": [entry(a, v) for a, v in ranked]})
    return {"content": content}


def new_logprobs(c: CompletionOutput, ids: list[int]) -> list[TokenLogprobs]:
    """The logprobs of `ids`, the last tokens of `c`, with -inf (masked by a grammar) made finite."""
    lps = [] if c.logprobs is None else c.logprobs[len(c.logprobs) - len(ids) :]
    return [{t: max(v, MASKED_LOGPROB) for t, v in lp.items()} for lp in lps]


def usage(outs: list[RequestOutput]) -> dict:
    """Tokens actually produced: every choice's tokens; each prompt counted once (n samples share it)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.metrics.num_cached_prompt_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def header(rid: str, obj: str, created: int, model: str) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model}
