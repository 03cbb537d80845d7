"""Per-request sampling parameters (vLLM's names), validated before anything is scheduled."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from baton.serve.core.structured import StructuredOutputs

SAMPLING_EPS = 1e-5  # temperatures below this run as greedy (vLLM's _SAMPLING_EPS)
_INT32_MAX = 2**31 - 1  # the proto's int32 fields; nothing sane is larger
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("n", "max_tokens", "top_k", "seed", "logprobs")
_OPTIONAL = ("seed", "logprobs")  # None: no seed / no logprobs
_BOOLS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
    """A real number that float() holds finitely (10**400 overflows, so it is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass
class Thinking:
    """A reasoning model's thinking phase at the start of the output (serve/core/structured.py's
    SequenceGrammar enforces it). While thinking, the structured-output grammar is not applied;
    once the output ends with `end_token_ids` (the tokenized end-of-thinking marker, e.g. "</think>",
    possibly several tokens), thinking is over and the grammar applies from the next token, as vLLM
    applies response_format after reasoning. `budget` (a Baton extra): after that many output tokens
    still thinking, the marker is forced, token by token."""

    end_token_ids: list[int]
    budget: int | None = None  # max reasoning tokens; None: unlimited
    in_thinking: bool = True  # False: the output starts after thinking (the prompt closed it)

    def validate(self, vocab_size: int | None) -> None:
        ids = self.end_token_ids
        if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"thinking.end_token_ids must be a non-empty list of token ids, got {ids!r}")
        if vocab_size is not None and (bad := [t for t in ids if t >= vocab_size]):
            raise ValueError(
                f"thinking.end_token_ids contains {bad[0]!r}, outside the vocabulary (0..{vocab_size - 1})"
            )
        if self.budget is not None and not (_is_int(self.budget) and 0 <= self.budget <= _INT32_MAX):
            raise ValueError(f"thinking.budget must be an integer >= 0 (and < 2**31) or null, got {self.budget!r}")
        if not isinstance(self.in_thinking, bool):
            raise ValueError(f"thinking.in_thinking must be true or false, got {self.in_thinking!r}")


@dataclass
class SamplingParams:
    n: int = 1  # parallel samples; they share the prompt's KV blocks (copy-on-write)
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below SAMPLING_EPS) = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # CTRL-style, over prompt + output
    presence_penalty: float = 0.0  # OpenAI-style, over output
    frequency_penalty: float = 0.0
    seed: int | None = None  # any int64; same seed -> same tokens, whatever the batch (speculation: docs/serving.md)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token (the sampled one is always included)
    skip_special_tokens: bool = True
    structured: StructuredOutputs | None = None  # constrain the output (serve/core/structured.py)
    thinking: Thinking | None = None  # the output starts with reasoning: no grammar there, an optional budget

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field. Everything accepted here must sample without
        NaN/inf (the sampler relies on it), and the wire admits NaN, inf and ints past int64."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for name in _FLOATS:
            value = getattr(self, name)
            need(_finite(value), f"{name} must be a finite number, got {value!r}")
        for name in _INTS:
            value = getattr(self, name)
            need(_is_int(value) or value is None and name in _OPTIONAL, f"{name} must be an integer, got {value!r}")
        for name in _BOOLS:
            need(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        need(1 <= self.n <= _INT32_MAX, f"n must be an integer >= 1 (and < 2**31), got {self.n!r}")
        need(1 <= self.max_tokens <= _INT32_MAX, f"max_tokens must be >= 1 (and < 2**31), got {self.max_tokens!r}")
        need(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        need(
            self.top_k in (-1, 0) or 1 <= self.top_k <= _INT32_MAX,
            f"top_k must be -1, 0 or positive (< 2**31), got {self.top_k!r}",
        )
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        need(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in 0..20, got {self.logprobs!r}")
        need(
            self.seed is None or -(2**63) <= self.seed < 2**63,
            f"seed must be in the int64 range [-2**63, 2**63 - 1], got {self.seed!r}",
        )
        need(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        bad = next((t for t in self.stop_token_ids if not _is_int(t) or t < 0), None)
        need(bad is None, f"stop_token_ids must be non-negative integers, got {bad!r}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids contains {bad[0]!r}, outside the vocabulary (0..{vocab_size - 1})")
        if self.structured is not None:
            need(isinstance(self.structured, StructuredOutputs), "structured must be a StructuredOutputs")
            self.structured.validate()
        if self.thinking is not None:
            need(isinstance(self.thinking, Thinking), "thinking must be a Thinking")
            self.thinking.validate(vocab_size)

    @property
    def greedy(self) -> bool:
        """Greedy is the limit of sampling as temperature -> 0; below SAMPLING_EPS (as in vLLM) it is
        taken, rather than dividing logits by a number that tiny."""
        return self.temperature < SAMPLING_EPS
