"""A per-batch decoding cache for the hybrid family: dense K/V for attention layers, the recurrent
state (conv window + SSM state, baton.common.ssm.MambaState) for Mamba2 mixer layers.

It is passed to CausalLM.forward where an attention backend goes (the model never decides how
attention or state is kept), and it is the model-level reference for carrying state: prefill in
pieces, then one token per step, each step's mixer cost independent of the context length. The
server keeps the same state in slots beside its paged KV pool instead (serve/state_pool.py).
Works for the attention-only families too (they simply have no mixers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from baton.common.ssm import Mamba2Mixer, MambaState


class HybridCache:
    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.recurrent: dict[int, MambaState] = {}
        self.num_tokens = 0

    def forward(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits for input_ids [B, S] continuing the sequences held here."""
        start, self.num_tokens = self.num_tokens, self.num_tokens + input_ids.shape[1]
        positions = torch.arange(start, self.num_tokens, device=input_ids.device).expand_as(input_ids)
        return model(input_ids, positions, self)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer) -> torch.Tensor:
        """Attention backend: append this step's k/v, attend causally over everything cached."""
        if layer.sliding_window is not None:
            raise NotImplementedError("HybridCache keeps whole sequences; it has no sliding window")
        past = self.kv.get(layer.layer_idx)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        self.kv[layer.layer_idx] = (k, v)
        s, t = q.shape[1], k.shape[1]
        rows = torch.arange(s, device=q.device)[:, None] + (t - s)
        mask = torch.arange(t, device=q.device)[None, :] <= rows
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
        return out.transpose(1, 2)

    def mix(self, mixer: Mamba2Mixer, x: torch.Tensor) -> torch.Tensor:
        """Run a mixer from its carried state and keep the new one."""
        y, self.recurrent[mixer.layer_idx] = mixer.mix(x, self.recurrent.get(mixer.layer_idx))
        return y


@torch.no_grad()
def cached_greedy_generate(model, prompt: torch.Tensor, max_new_tokens: int, prefill_chunk: int | None = None):
    """Greedy decoding with the cache: the prompt in pieces of `prefill_chunk` tokens (all at once
    when None), then one token per step."""
    cache = HybridCache()
    step = prefill_chunk or prompt.shape[1]
    for i in range(0, prompt.shape[1], step):
        logits = cache.forward(model, prompt[:, i : i + step])
    out = [logits[:, -1].argmax(-1, keepdim=True)]
    while len(out) < max_new_tokens:
        out.append(cache.forward(model, out[-1])[:, -1].argmax(-1, keepdim=True))
    return torch.cat(out, dim=-1)[:, :max_new_tokens]
