"""What speculative decoding is asked to do (SpeculativeConfig), and how well it is doing."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.serve.core.sequence import Sequence
from baton.serve.speculative import METHODS
from baton.serve.speculative.tree import parse_choices


@dataclass
class SpeculativeConfig:
    method: str  # one of METHODS
    num_speculative_tokens: int = 4  # k: the deepest proposal (adaptive k may use fewer)
    draft_model: str | None = None  # checkpoint dir, for method "draft"
    draft_kv_cache_bytes: int = 64 * 1024**2
    tree_width: int = 1  # >1 (draft, medusa, eagle): a token tree, each expanded node's top-`tree_width` children
    tree_nodes: int | None = None  # a tree's node budget (default k * tree_width)
    tree_choices: str | None = None  # medusa: a fixed topology, JSON paths of top-k ranks ("[[0],[1],[0,0]]")
    lookahead_window: int = 4  # W: Jacobi window positions (lookahead)
    lookahead_ngram: int = 4  # N: n-gram size; N-1 Jacobi levels kept, guesses N-1 tokens deep
    lookahead_guesses: int = 4  # G: n-gram guesses verified per step
    exit_layer: int | None = None  # layerskip: draft from the first E layers (None: the checkpoint's first exit)
    ngram_max: int = 4
    ngram_min: int = 1
    adaptive: bool = False  # adapt k per sequence from its running acceptance rate
    disable_above_batch: int | None = None  # no speculation while more sequences than this decode
    speedup_probe_every: int | None = None  # every Nth decode step runs plain: a baseline for the measured speed-up

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (a checkpoint directory)")
        if self.disable_above_batch is not None and self.disable_above_batch < 1:
            raise ValueError(f"disable_above_batch must be >= 1 (or None), got {self.disable_above_batch}")
        if self.speedup_probe_every is not None and self.speedup_probe_every < 2:
            raise ValueError(f"speedup_probe_every must be >= 2 (or None), got {self.speedup_probe_every}")
        if self.tree_width < 1 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need tree_width >= 1 and 1 <= ngram_min <= ngram_max")
        if self.draft_model and self.method != "draft":
            raise ValueError(f"draft_model is for speculative method 'draft', not {self.method!r}")
        if self.exit_layer is not None and (self.method != "layerskip" or self.exit_layer < 1):
            raise ValueError(
                f"exit_layer is a layer count >= 1 for speculative method 'layerskip', got {self.exit_layer}"
            )
        tree = self.tree_width > 1 or self.tree_nodes is not None or self.tree_choices is not None
        if tree and self.method not in ("draft", "medusa", "layerskip", "eagle"):
            raise ValueError(
                "token trees (tree_width/tree_nodes/tree_choices) are for draft, medusa, layerskip and eagle, "
                f"not {self.method!r}"
            )
        if self.tree_nodes is not None and self.tree_nodes < 1:
            raise ValueError(f"tree_nodes must be >= 1, got {self.tree_nodes}")
        if self.tree_choices is not None:
            if self.method != "medusa" or self.tree_width > 1 or self.tree_nodes is not None:
                raise ValueError(
                    "tree_choices is a fixed Medusa topology: method 'medusa', without tree_width/tree_nodes"
                )
            parse_choices(self.tree_choices)
        if self.method == "lookahead":
            if self.adaptive:
                raise ValueError("lookahead sizes its guesses by lookahead_ngram, not adaptive k")
            if self.lookahead_window < 1 or self.lookahead_ngram < 2 or self.lookahead_guesses < 1:
                raise ValueError("lookahead needs lookahead_window >= 1, lookahead_ngram >= 2, lookahead_guesses >= 1")

    def describe(self) -> str:
        """The mode in a few words (ModelInfo's speculative_mode), e.g. "draft k=3 tree_width=2 tree_nodes=6"."""
        if self.method == "lookahead":
            return f"lookahead W={self.lookahead_window} N={self.lookahead_ngram} G={self.lookahead_guesses}"
        out = f"{self.method} k={self.num_speculative_tokens}"
        if self.method == "layerskip":
            out += f" exit_layer={self.exit_layer if self.exit_layer is not None else 'recorded'}"
        if self.tree_choices is not None:
            return out + f" tree_choices={self.tree_choices}"
        return out + (f" tree_width={self.tree_width} tree_nodes={self.node_budget}" if self.tree_width > 1 else "")

    @property
    def node_budget(self) -> int:
        """The most nodes a draft/Medusa token tree gets."""
        return self.tree_nodes if self.tree_nodes is not None else self.num_speculative_tokens * self.tree_width


@dataclass
class SpecStats:
    steps: int = 0  # verification passes
    proposed: int = 0
    accepted: int = 0
    # Per depth d (index d - 1): passes that proposed a token that deep, and passes that accepted one.
    proposed_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    # Decode-only engine steps by the number of sequences in them: [seconds, tokens] of the steps that
    # verified proposals, and of the plain ones (no sequence had any) - the speed-up compares the two.
    # Timings differ between runs of the same tokens: equality of two SpecStats leaves them out.
    spec_steps: dict[int, list[float]] = field(default_factory=dict, compare=False)
    plain_steps: dict[int, list[float]] = field(default_factory=dict, compare=False)

    def count(self, proposed: int, deepest: int, accepted: int) -> None:
        """One verification pass: `proposed` candidates reaching `deepest`, `accepted` of them kept."""
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        for counts, upto in ((self.proposed_by_depth, deepest), (self.accepted_by_depth, accepted)):
            counts.extend([0] * (upto - len(counts)))
            for d in range(upto):
                counts[d] += 1

    def time_step(self, batch: int, speculative: bool, seconds: float, tokens: int) -> None:
        """One decode-only engine step of `batch` sequences (proposing, the forward, verifying)."""
        acc = (self.spec_steps if speculative else self.plain_steps).setdefault(batch, [0.0, 0])
        acc[0] += seconds
        acc[1] += tokens

    @property
    def speedup(self) -> float:
        """Measured speed-up: the time plain decode steps of the same batch size would have taken for
        the tokens the speculative steps produced, over the time those took. 0 until both kinds have
        run at some batch size (plain ones come where nothing was proposed: no n-gram match, the last
        token before max_tokens, disable_above_batch)."""
        both = [b for b in self.spec_steps if self.plain_steps.get(b, (0, 0))[1] > 0]
        plain_time = sum(self.spec_steps[b][1] * self.plain_steps[b][0] / self.plain_steps[b][1] for b in both)
        spec_time = sum(self.spec_steps[b][0] for b in both)
        return plain_time / spec_time if spec_time > 0 else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Share of the passes proposing depth d whose accepted path reached it."""
        return [
            a / p for a, p in zip(self.accepted_by_depth + [0] * len(self.proposed_by_depth), self.proposed_by_depth)
        ]

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
