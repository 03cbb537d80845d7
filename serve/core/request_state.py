"""One request inside the engine: its samples, what was already reported of each, and its outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass

from baton.serve.core.detokenizer import IncrementalDetokenizer
from baton.serve.core.sequence import Sequence
from baton.serve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from baton.serve.sampling_params import SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer | None]
    emitted_text: list[str]  # text already reported per sample (stop-string hold-back)
    reported_tokens: list[int]
    error: str | None = None  # why the engine failed it (then every sample is retired)
    final_only: bool = False  # report the final output alone (the offline LLM's; vLLM's FINAL_ONLY)

    def output(self, final: bool) -> RequestOutput:
        """Cumulative and new text/tokens per sample since the last output. A failed request adds
        nothing: its final output repeats what was reported, with finish_reason "error"."""
        hold = max((len(s) for s in self.params.stop), default=1) - 1  # never stream a partial stop string
        outs = []
        for i, seq in enumerate(self.seqs):
            emitted = self.emitted_text[i]
            if self.error is not None:
                outs.append(
                    CompletionOutput(seq.index, emitted, seq.output_token_ids[: self.reported_tokens[i]], "error")
                )
                continue
            text = seq.output_text
            visible = text if seq.is_finished or hold == 0 else text[: max(len(emitted), len(text) - hold)]
            self.emitted_text[i] = visible
            out_ids = seq.output_token_ids  # a new list (a slice): the output's own copy
            new_ids = out_ids[self.reported_tokens[i] :]
            self.reported_tokens[i] = len(out_ids)
            logprobs = list(seq.logprobs) if self.params.logprobs is not None else None
            outs.append(
                CompletionOutput(
                    seq.index,
                    visible,
                    out_ids,
                    seq.finish_reason,
                    seq.stop_reason,
                    logprobs,
                    visible[len(emitted) :],
                    new_ids,
                )
            )
        first = self.seqs[0]
        m = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.metrics.first_scheduled_time,
            first_token_time=min(
                (s.metrics.first_token_time for s in self.seqs if s.metrics.first_token_time), default=None
            ),
            finished_time=time.monotonic() if final else None,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_prompt_tokens=first.metrics.num_cached_prompt_tokens,
            num_generated_tokens=sum(s.num_output_tokens for s in self.seqs),
            num_preemptions=sum(s.metrics.num_preemptions for s in self.seqs),
        )
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, final, m, self.error)
