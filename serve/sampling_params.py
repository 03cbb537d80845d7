"""Per-request sampling parameters (vLLM's names), validated before anything is scheduled."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1  # parallel samples; they share the prompt's KV blocks (copy-on-write)
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # CTRL-style, over prompt + output
    presence_penalty: float = 0.0  # OpenAI-style, over output
    frequency_penalty: float = 0.0
    seed: int | None = None  # per-request generator: same seed -> same tokens, whatever the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token (the sampled one is always included)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens!r}")
        need(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        need(isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1), f"top_k must be -1, 0 or positive, got {self.top_k!r}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        need(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be in 0..20, got {self.logprobs!r}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        need(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
            if bad:
                raise ValueError(f"stop_token_ids contains {bad[0]!r}, outside the vocabulary (0..{vocab_size - 1})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
