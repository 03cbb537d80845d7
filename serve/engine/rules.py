"""What combines with what: every cross-feature rule of the engine in one table, checked once before
anything starts (LLMEngine before it builds pools, `baton serve` before it binds a port, the
distributed start before it spawns a worker). EngineConfig.validate checks each field alone; this
file only the combinations. A rule that needs the model is skipped where none is known yet.

Read a row as "this refuses that, because": the first row that applies raises, with its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from baton.common.config import ConfigError, ModelConfig
from baton.serve.engine.config import EngineConfig


@dataclass(frozen=True)
class Setting:
    """What a rule looks at: the engine's config, the model's (None before it is read), and whether
    the model is sharded over worker processes."""

    config: EngineConfig
    model: ModelConfig | None
    sharded: bool


@dataclass(frozen=True)
class Rule:
    applies: Callable[[Setting], bool]  # the refused combination is present
    why: str | Callable[[Setting], str]
    kind: str = "plain"  # "hybrid" / "mla" / "early_exit": the message says which feature refuses


def _spec_tree(s: Setting) -> bool:
    spec = s.config.speculative
    return spec is not None and (
        spec.method == "lookahead" or spec.tree_width > 1 or bool(spec.tree_nodes or spec.tree_choices)
    )


def _hybrid(s: Setting) -> bool:
    return s.model is not None and s.model.is_hybrid


def _early_exit(s: Setting) -> bool:
    return s.config.early_exit_threshold is not None


def _mla(s: Setting) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent row a token a layer."""
    return s.model is not None and s.model.is_mla


RULES: list[Rule] = [
    Rule(
        lambda s: s.config.speculative is not None and s.config.streaming,
        "speculative decoding and StreamingLLM cannot be combined",
    ),
    Rule(
        lambda s: s.config.streaming and s.config.kv_cache_dtype != "auto",
        "StreamingLLM re-rotates cached keys in place: use kv_cache_dtype='auto' with it",
    ),
    # MLA's latent cache (serve/runner/mla_attention.py): what it cannot do yet.
    Rule(
        lambda s: _mla(s) and s.config.streaming,
        "StreamingLLM re-rotates cached per-head keys; the latent cache keeps each token's rope key inside "
        "its latent row, which re-rotation does not handle",
        "mla",
    ),
    Rule(
        lambda s: _mla(s) and s.config.kv_cache_dtype != "auto",
        "a quantized KV cache packs per-head K/V rows with a scale; the latent cache is kept in the model's "
        "dtype: use kv_cache_dtype='auto'",
        "mla",
    ),
    Rule(
        lambda s: _mla(s) and _early_exit(s),
        "CALM early exit fills the skipped layers' per-head K/V, not the latent cache",
        "mla",
    ),
    # Hybrids (recurrent mixers + attention): what the recurrent-state slots cannot do yet.
    Rule(
        lambda s: _hybrid(s) and s.model.mixer == "gated_deltanet",
        "its Gated DeltaNet layers are not served yet: the state pool holds Mamba2 states only (training, "
        "HF interop and `baton convert` work; serving is the next step of issue 44)",
        "hybrid",
    ),
    Rule(
        lambda s: _hybrid(s) and s.config.parallel.world_size > 1,
        "tensor/pipeline parallel serving is not supported for it: the sharded workers hold KV pools only, "
        "no recurrent-state slots, and the mixer's in_proj packs z, x, B, C and dt, so one rank's columns "
        "are five ranges the shard loader's one-range slices cannot express (serve it with tp = pp = 1)",
        "hybrid",
    ),
    Rule(
        lambda s: _hybrid(s) and _early_exit(s),
        "CALM early exit skips layers for a token, and a skipped mixer's state would miss that token",
        "hybrid",
    ),
    Rule(
        lambda s: _hybrid(s) and s.config.streaming,
        "StreamingLLM evicts attention blocks, but the mixers' state keeps the whole past: it does not apply",
        "hybrid",
    ),
    Rule(
        lambda s: _hybrid(s) and _spec_tree(s),
        lambda s: (
            f"speculative {s.config.speculative.describe()} needs state per tree node or Jacobi window row; "
            "the state pool checkpoints a chain only (use a chain: ngram, draft or medusa without a tree)"
        ),
        "hybrid",
    ),
    Rule(
        lambda s: s.config.speculative is not None and s.config.speculative.method == "mtp" and s.sharded,
        "--speculative mtp runs the MTP modules on the engine's own model in this process: not with "
        "tensor/pipeline parallel serving yet (serve it with tp = pp = 1)",
    ),
    # CALM confidence early exit (serve/runner/early_exit.py).
    Rule(
        lambda s: _early_exit(s) and s.model is not None and not s.model.early_exit_layers,
        "early_exit_threshold needs a checkpoint with recorded early exits (early_exit_layers in "
        "config.json, written by a `baton train` recipe with an early_exit: section)",
    ),
    Rule(
        lambda s: _early_exit(s) and _hybrid(s),
        "a hybrid (recurrent-mixer) model: its mixer layers have no K/V to fill",
        "early_exit",
    ),
    Rule(
        lambda s: _early_exit(s) and s.config.speculative is not None,
        "speculative decoding (verification needs full depth)",
        "early_exit",
    ),
    Rule(
        lambda s: _early_exit(s) and s.sharded,
        "tensor/pipeline parallel serving (it runs on a single-process model)",
        "early_exit",
    ),
    Rule(
        lambda s: _early_exit(s) and s.config.streaming,
        "StreamingLLM (the fill is not checked against a reference under its evictions and re-rotated keys)",
        "early_exit",
    ),
    Rule(
        lambda s: _early_exit(s) and s.config.kv_cache_dtype != "auto",
        "a quantized KV cache (the filled K/V are written unquantized): use kv_cache_dtype 'auto'",
        "early_exit",
    ),
]


def check(config: EngineConfig, model: ModelConfig | None, sharded: bool | None = None) -> None:
    """Raise for the first rule that applies (ConfigError for a hybrid's or MLA's, else ValueError); `sharded`
    defaults to the config's parallel layout."""
    s = Setting(config, model, config.parallel.world_size > 1 if sharded is None else sharded)
    for rule in RULES:
        if not rule.applies(s):
            continue
        why = rule.why(s) if callable(rule.why) else rule.why
        if rule.kind == "hybrid":
            raise ConfigError(f"model_type {s.model.model_type!r} ({s.model.mixer} + attention hybrid): {why}")
        if rule.kind == "mla":
            raise ConfigError(f"model_type {s.model.model_type!r} (multi-head latent attention): {why}")
        if rule.kind == "early_exit":
            raise ValueError(f"early_exit_threshold cannot be combined with {why}")
        raise ValueError(why)
