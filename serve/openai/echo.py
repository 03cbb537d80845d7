"""Prompt logprobs for completions' `echo` with `logprobs` (how lm-eval scores loglikelihood).

The engine samples only new tokens, so the prompt is scored with one plain causal forward of
the in-process model, run under the engine's lock (serve/async_engine.py's snapshot) so it never
races a step. Position i's distribution scores prompt token i + 1; the first token has none.
"""

from __future__ import annotations

import torch

from baton.serve.engine import LLMEngine


def prompt_logprobs(engine: LLMEngine, ids: list[int], k: int) -> list[dict[int, float] | None]:
    """[None, {token_1: lp, top-k...}, ...] for the prompt `ids` (raw model logprobs, as sampling reports)."""
    model = engine.model
    if model is None:
        raise ValueError("echo with logprobs needs the model in this process (not tensor/pipeline parallel serving)")
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=device))[0, :-1].float()
        lp = torch.log_softmax(logits, -1)
        targets = torch.tensor(ids[1:], device=device)
        chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        top = torch.topk(lp, min(k, lp.shape[-1])) if k > 0 else None
        top_v = top.values.tolist() if top is not None else [[] for _ in chosen]
        top_i = top.indices.tolist() if top is not None else [[] for _ in chosen]
    out: list[dict[int, float] | None] = [None]
    for t, v, vs, ix in zip(ids[1:], chosen, top_v, top_i):
        d = {t: v}
        d.update(zip(ix, vs))
        out.append(d)
    return out
