"""What the engine hands back, shaped like vLLM's RequestOutput/CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative
    token_ids: list[int]  # cumulative
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (the request failed)
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set (with finished) when the engine failed this request; see serve/engine/engine.py
