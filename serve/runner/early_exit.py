"""CALM-style confidence early exit (Schuster et al., 2022) at decode: `--early-exit-threshold t`.

A decoding token leaves the network at the first recorded exit E (the checkpoint's
early_exit_layers, trained by baton.train.early_exit) where the softmax of the shared final norm +
LM head over its hidden state has a maximum >= t; it is then sampled from those exit logits. Its
K/V in the skipped layers E..L-1 are filled by CALM's state propagation: each skipped layer's K/V
projections are computed from the exit layer's hidden state (the state is copied upwards), so
later tokens attend to every layer of every position. Prompt tokens, and the first token after
the prompt, always run the whole depth; only single-token decode rows may exit.

Not exact: the output differs from full-depth decoding wherever an exit is taken (docs/serving.md;
benchmarks/speculative.py measures agreement, perplexity and speed over thresholds).

Compute: an exited row runs only the K/V projections of the layers it skips, the rows still in
run the whole layer, in one sub-batch (the attention metadata narrowed to them). A runner wrapper
around a plain ModelRunner, installed by the engine from outside; sharded runners, speculative
decoding, StreamingLLM, quantized KV pools and hybrid models are refused (serve/engine/rules.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
from baton.common.rope import rotary_cos_sin
from baton.serve.core.sequence import Sequence
from baton.serve.runner.attention import AttentionMetadata
from baton.serve.runner.model_runner import ExecuteResult, ModelRunner


class ConfidenceExit:
    """A Runner around a plain ModelRunner: `execute` exits early, every other member is the inner
    runner's. `exits` counts tokens per exit (L: full depth)."""

    def __init__(self, runner: ModelRunner, threshold: float, exit_layers: list[int]):
        self.runner, self.threshold, self.exit_layers = runner, threshold, set(exit_layers)
        self.exits: Counter[int] = Counter()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def submit(self, *args) -> ExecuteResult:  # one step at a time (max_in_flight 1): the step itself
        return self.execute(*args)

    def collect(self, result: ExecuteResult) -> ExecuteResult:
        return result

    def stats(self) -> dict[str, list[int]]:
        """EngineStats' early_exit_* fields: tokens per exit layer, every exit listed, full depth last."""
        layers = sorted(self.exit_layers) + [len(self.runner.layers)]
        return {"early_exit_layers": layers, "early_exit_tokens": [self.exits[e] for e in layers]}

    def execute(
        self,
        scheduled: list[tuple[Sequence, int]],
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
    ) -> ExecuteResult:
        r = self.runner
        plan, groups = r.plan(scheduled, positions_in_cache, window_in_cache, return_hidden)
        chunks = plan.chunks
        fed_generated = {s.seq_id for s, n in scheduled if n == 1 and s.num_output_tokens > 0}
        eligible, row = [], 0
        for c in chunks:  # packing order: single-token decode rows come first
            if len(c.tokens) == 1 and c.sample == "last" and c.seq_id in fed_generated:
                eligible.append(row)
            row += len(c.tokens)
        logits, hidden = r.head(plan, self.forward(plan, eligible))
        return ExecuteResult(logits, groups, hidden)

    @torch.inference_mode()
    def forward(self, plan, eligible: list[int]) -> torch.Tensor:
        r = self.runner
        input_ids, positions, md = plan.tensors(r.device)
        inner = r.model.model
        if inner.inv_freq.device != r.device:
            inner.inv_freq = inner.inv_freq.to(r.device)
        x = inner.embed(input_ids)
        cos, sin = rotary_cos_sin(inner.inv_freq, positions, x.dtype)
        rows = torch.arange(x.shape[1], device=r.device)
        live = torch.ones(x.shape[1], dtype=torch.bool, device=r.device)  # rows still in the network
        cand = torch.tensor(eligible, dtype=torch.long, device=r.device)  # rows that may still exit
        try:
            for i, layer in enumerate(r.layers):
                if i in self.exit_layers and cand.numel():
                    probs = torch.softmax(r.model.compute_logits(inner.final_norm(x[0, cand])).float(), -1)
                    leave = probs.amax(-1) >= self.threshold
                    if leave.any():
                        self.exits[i] += int(leave.sum())
                        live[cand[leave]] = False
                        cand = cand[~leave]
                if bool(live.all()):
                    r.attn.metadata = md
                    x = layer(x, cos, sin, r.attn)
                    continue
                out, gone = x.clone(), rows[~live]
                # CALM's fill: the skipped layer's K/V from the exit state (attention output unused)
                r.attn.metadata = _writes_only(md, gone)
                layer.self_attn(layer.input_layernorm(x[:, gone]), cos[:, gone], sin[:, gone], r.attn)
                if live.any():
                    keep = rows[live]
                    r.attn.metadata = _narrowed(md, live)
                    out[:, keep] = layer(x[:, keep], cos[:, keep], sin[:, keep], r.attn)
                x = out
        finally:
            r.attn.metadata = None
        self.exits[len(r.layers)] += int(cand.numel())
        return x


def _writes_only(md: AttentionMetadata, rows: torch.Tensor) -> AttentionMetadata:
    """Metadata that writes these rows' K/V to their slots and attends nothing."""
    empty = md.decode_block_tables[:0]
    return dataclasses.replace(
        md,
        slot_mapping=md.slot_mapping[rows],
        num_decodes=0,
        decode_block_tables=empty,
        decode_context_lens=md.decode_context_lens[:0],
        prefill_cu_seqlens=md.prefill_cu_seqlens[:1],
        prefill_block_tables=md.prefill_block_tables[:0],
        prefill_prefix_lens=md.prefill_prefix_lens[:0],
        max_prefill_len=0,
        trees=[],
    )


def _narrowed(md: AttentionMetadata, live: torch.Tensor) -> AttentionMetadata:
    """The metadata of the live rows only: exits are decode rows, so only the decode part shrinks."""
    dec = live[: md.num_decodes]
    return dataclasses.replace(
        md,
        slot_mapping=md.slot_mapping[live],
        num_decodes=int(dec.sum()),
        decode_block_tables=md.decode_block_tables[dec],
        decode_context_lens=md.decode_context_lens[dec],
    )


def apply_early_exit(runner: ModelRunner, threshold: float) -> ConfidenceExit:
    """Confidence early exit around `runner` at the checkpoint's recorded exits (serve/engine/rules.py
    says what it cannot be combined with)."""
    return ConfidenceExit(runner, threshold, runner.model.config.early_exit_layers)
