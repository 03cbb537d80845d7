"""EngineStats: one consistent reading of the engine, for /metrics, ServerInfo and benchmarks.

LLMEngine.stats() fills it (the server reads it under the engine lock, so a scrape or a
ServerInfo sees one engine state); the runtime adds its admission counts. The field names are
ServerInfoResponse's, which is built from dataclasses.asdict (tests/serve/test_server_units.py
checks that every proto field is covered).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    engine_requests: int  # requests the engine holds (any state)
    waiting_seqs: int
    running_seqs: int
    swapped_seqs: int
    kv_blocks_total: int  # the full-attention layers' pool (every layer's, without KV groups)
    kv_blocks_free: int
    prefix_cache_hit_rate: float
    preemptions: int  # since start, as are the token counts below
    prompt_tokens: int
    generation_tokens: int
    spec_proposed_tokens: int  # speculative decoding: all zero without it
    spec_accepted_tokens: int
    spec_acceptance_rate: float
    spec_mean_accepted_length: float
    kv_window_blocks_total: int = 0  # KV groups: the sliding-window layers' own pool (0: one group)
    kv_window_blocks_free: int = 0
    active_calls: int = 0  # the server's admission: generation calls in the engine, and waiting for it
    queued_calls: int = 0
    # Speculative decoding per depth d (index d - 1): verification passes that proposed a token that
    # deep, and passes whose accepted path reached it (SpecStats)
    spec_proposed_by_depth: list[int] = field(default_factory=list)
    spec_accepted_by_depth: list[int] = field(default_factory=list)
    spec_method: str = "none"  # SpeculativeConfig.method: the mode these spec_* numbers are of
    spec_speedup: float = 0.0  # measured against plain decode steps of the same batch size (SpecStats.speedup)
    # CALM confidence early exit (serve/runner/early_exit.py): decode tokens by the depth they ran,
    # early_exit_tokens[i] having left after early_exit_layers[i] layers (the last: the full depth)
    early_exit_layers: list[int] = field(default_factory=list)
    early_exit_tokens: list[int] = field(default_factory=list)
