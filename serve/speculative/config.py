"""What speculative decoding is asked to do (SpeculativeConfig), and how well it is doing."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.serve.sequence import Sequence

METHODS = ("ngram", "draft", "medusa")


@dataclass
class SpeculativeConfig:
    method: str  # "ngram" | "draft" | "medusa"
    num_speculative_tokens: int = 4  # k (the most; adaptive k may use fewer)
    draft_model: str | None = None  # checkpoint dir, for method "draft"
    draft_kv_cache_bytes: int = 64 * 1024**2
    tree_width: int = 1  # >1: a token tree with this many alternatives at each depth
    ngram_max: int = 4
    ngram_min: int = 1
    adaptive: bool = False  # adapt k per sequence from its running acceptance rate
    disable_above_batch: int | None = None  # no speculation while more sequences than this decode

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (a checkpoint directory)")
        if self.disable_above_batch is not None and self.disable_above_batch < 1:
            raise ValueError(f"disable_above_batch must be >= 1 (or None), got {self.disable_above_batch}")
        if self.tree_width < 1 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need tree_width >= 1 and 1 <= ngram_min <= ngram_max")


@dataclass
class SpecStats:
    steps: int = 0  # verification passes
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification pass (accepted proposals + the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass
class AdaptiveK:
    """k from the running acceptance rate a: the expected run of accepted tokens is a/(1-a)."""

    k_max: int
    enabled: bool
    rates: dict[int, float] = field(default_factory=dict)

    def k(self, seq: Sequence) -> int:
        if not self.enabled:
            return self.k_max
        a = self.rates.get(seq.seq_id, 0.7)
        return max(1, min(self.k_max, round(a / max(1e-3, 1 - a)) + 1))

    def update(self, seq: Sequence, proposed: int, accepted: int) -> None:
        if proposed:
            self.rates[seq.seq_id] = 0.7 * self.rates.get(seq.seq_id, 0.7) + 0.3 * accepted / proposed

    def forget(self, seq: Sequence) -> None:
        self.rates.pop(seq.seq_id, None)
