"""StreamingLLM (attention sinks + window) against an independent re-rotating reference, and
sliding-window models keeping only their window."""

from __future__ import annotations

import torch

from baton.common.checkpoint import load_checkpoint
from baton.common.config import ModelConfig
from baton.common.model import build_model, greedy_generate
from baton.common.rope import rotary_cos_sin
from baton.kernels.reference import apply_rotary_ref
from baton.common.checkpoint import save_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams

from .conftest import make_hf_checkpoint


class StreamingReference:
    """The paper's algorithm, token by token: keys cached *before* RoPE, rotated by their cache
    index at every step; the first `sinks` tokens kept, the middle evicted `evict` at a time."""

    def __init__(self, model, sinks: int, window: int, evict: int):
        self.model, self.sinks, self.window, self.evict = model, sinks, window, evict
        self.keys = [[] for _ in model.model.layers]  # per layer: list of pre-RoPE k [Hkv, D]
        self.values = [[] for _ in model.model.layers]

    def _backend(self, positions):
        def attend(q, k, v, layer):
            i = layer.layer_idx
            cos, sin = rotary_cos_sin(self.model.model.inv_freq, positions, q.dtype)
            unrot_k = apply_rotary_ref(k[0], k[0], cos[0], -sin[0])[0][None]  # undo RoPE at the query's position
            self.keys[i].append(unrot_k[0, 0])
            self.values[i].append(v[0, 0])
            n = len(self.keys[i])
            kc, kc_sin = rotary_cos_sin(self.model.model.inv_freq, torch.arange(n), q.dtype)
            keys = torch.stack(self.keys[i])
            keys = keys * kc.unsqueeze(1) + torch.cat(
                [-keys[..., keys.shape[-1] // 2 :], keys[..., : keys.shape[-1] // 2]], -1
            ) * kc_sin.unsqueeze(1)
            vals = torch.stack(self.values[i])
            group = q.shape[2] // keys.shape[1]
            keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
            scores = torch.einsum("hd,nhd->hn", q[0, 0], keys) * layer.scaling
            return torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)[None, None]

        return attend

    @torch.no_grad()
    def step(self, token: int) -> int:
        if len(self.keys[0]) + 1 - self.sinks - self.window >= self.evict:  # mirror the engine's block eviction
            for lst in self.keys + self.values:
                del lst[self.sinks : self.sinks + self.evict]
        pos = torch.tensor([[len(self.keys[0])]])
        logits = self.model(torch.tensor([[token]]), positions=pos, attn=self._backend(pos))
        return int(logits[0, -1].argmax())


def test_streaming_llm_matches_reference_far_past_context(tmp_path):
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    model = build_model(cfg, seed=3)
    save_model(tmp_path / "m", model)
    bs, sinks, window, steps = 4, 4, 24, 320  # 5x the 64-token context
    engine = LLMEngine.from_checkpoint(
        tmp_path / "m",
        EngineConfig(num_kv_blocks=16, block_size=bs, streaming_sink_tokens=sinks, streaming_window_tokens=window),
    )
    prompt = [5, 17, 9, 30, 2, 77]
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            result = out.outputs[0].token_ids
        peak = max(peak, engine.block_manager.num_used_blocks)
    assert len(result) == steps
    assert peak <= (sinks + window) // bs + 2, f"memory must stay flat, peaked at {peak} blocks"

    ref = StreamingReference(load_checkpoint(tmp_path / "m").model, sinks, window, evict=bs)
    tokens = list(prompt)
    expected = []
    nxt = None
    for t in tokens:
        nxt = ref.step(t)
    for _ in range(steps):
        expected.append(nxt)
        nxt = ref.step(nxt)
    agree = next((i for i, (a, b) in enumerate(zip(result, expected)) if a != b), steps)
    assert agree == steps, f"diverged from the reference at token {agree}"


def test_sliding_window_model_keeps_only_the_window(tmp_path):
    hf, ckpt = make_hf_checkpoint(tmp_path, "mistral")  # sliding_window=12
    model = load_checkpoint(ckpt).model
    prompt = list(range(10, 40))
    expected = greedy_generate(model, torch.tensor([prompt]), 60)[0].tolist()
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=32, block_size=4))
    engine.add_request("w", prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            result = out.outputs[0].token_ids
        peak = max(peak, engine.block_manager.num_used_blocks)
    assert result == expected
    assert peak <= 12 // 4 + 2 + 30 // 4, peak  # the prompt's chunk, then window + one block
    assert engine.block_manager.num_free_blocks == 32
