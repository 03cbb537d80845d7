"""Output processing: what happens to each sampled token, and to a request with n > 1.

append() puts the token on its sequence, advances the grammar matcher and the detokenizer, then
checks every stop condition in order (a stop token id, EOS unless ignored, a complete structure,
a stop string - the text cut before it, or after it with include_stop_str_in_output - max_tokens,
the model's context) and finishes the sequence through the engine's `retire`. fork() makes a
request's other n - 1 samples after its first step, sharing the parent's prompt blocks
(copy-on-write) through the engine's `place`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from baton.common.tokenizer import Tokenizer
from baton.serve.core.detokenizer import IncrementalDetokenizer
from baton.serve.core.request_state import RequestState
from baton.serve.core.sequence import Sequence, SequenceStatus
from baton.serve.sampler import SampleResult
from baton.serve.sampling_params import SamplingParams


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        eos_ids: set[int],
        max_model_len: int,
        streaming: bool,
        retire: Callable[[Sequence, str], None],
    ):
        self.tokenizer, self.eos_ids, self.max_model_len, self.streaming = tokenizer, eos_ids, max_model_len, streaming
        self.retire = retire  # the engine's: out of the scheduler and speculation, blocks freed
        self.num_generated_tokens = 0

    def detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        return IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None

    def append(self, req: RequestState, seq: Sequence, result: SampleResult, now: float) -> None:
        token = result.token_id
        seq.token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        self.num_generated_tokens += 1
        if result.logprobs is not None:
            seq.logprobs.append(result.logprobs)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        detok = req.detoks[seq.index]
        if detok is not None:
            detok.add(token)
            seq.output_text = detok.text
        p = seq.params
        if token in p.stop_token_ids:
            self.finish(req, seq, "stop", token)
        elif token in self.eos_ids and not p.ignore_eos:
            self.finish(req, seq, "stop", None)
        elif seq.grammar is not None and seq.grammar.terminated:  # the structure is complete
            self.finish(req, seq, "stop", None)
        elif p.stop and self._stop_string(req, seq):
            pass
        elif seq.num_output_tokens >= p.max_tokens:
            self.finish(req, seq, "length", None)
        elif not self.streaming and seq.num_tokens >= self.max_model_len:
            self.finish(req, seq, "length", None)

    def _stop_string(self, req: RequestState, seq: Sequence) -> bool:
        text = seq.output_text
        for stop in seq.params.stop:
            at = text.find(stop)
            if at >= 0:
                seq.output_text = text[: at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
                self.finish(req, seq, "stop", stop)
                return True
        return False

    def finish(self, req: RequestState, seq: Sequence, reason: str, stop_reason) -> None:
        detok = req.detoks[seq.index]
        if detok is not None and not isinstance(stop_reason, str):  # stop strings already cut the text
            detok.flush()
            seq.output_text = detok.text
        seq.stop_reason = stop_reason
        seq.metrics.finished_time = time.monotonic()
        self.retire(seq, reason)

    def fork(
        self, req: RequestState, parent: Sequence, seq_ids: itertools.count, place: Callable[[Sequence, Sequence], None]
    ) -> list[Sequence]:
        """n > 1: the other samples, each placed by the engine beside the parent (its blocks shared)."""
        children = []
        for i in range(1, req.params.n):
            child = Sequence(
                next(seq_ids),
                req.request_id,
                i,
                req.prompt_token_ids,
                req.params,
                parent.priority,
                parent.arrival_time,
                token_ids=list(parent.token_ids),
                num_computed_tokens=parent.num_computed_tokens,
                status=SequenceStatus.RUNNING,
            )
            child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            child.make_generator()
            child.grammar = parent.grammar.fork() if parent.grammar is not None else None
            place(parent, child)
            req.seqs.append(child)
            req.detoks.append(self.detokenizer(req.params))
            req.emitted_text.append("")
            req.reported_tokens.append(0)
            children.append(child)
        return children
