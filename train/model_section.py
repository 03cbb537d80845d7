"""The recipe's model section as a ModelConfig: a preset with the section's overrides, or with
`init_from` the checkpoint's own config (which the section may only repeat).

TrainConfig.model_config calls `model_config` here; the recipe checks call it without token ids,
before the tokenizer is known, the trainer with them. Reads config files only: no weights, no
backend (baton.train.pretrained loads the weights).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from baton.common.checkpoint import CheckpointError, weight_files
from baton.common.config import PRESETS, ConfigError, ModelConfig
from baton.common.hf import config_from_hf

log = logging.getLogger(__name__)


def model_config(
    section: dict[str, Any],
    init_from: str | None,
    exit_layers: Sequence[int],
    vocab_size: int,
    exits: bool = True,
    token_ids: dict[str, Any] | None = None,
) -> ModelConfig:
    """The model config of a recipe whose model section is `section`; vocab size and special token
    ids come from the tokenizer. The section may pad the vocabulary, but not shrink it below the
    tokenizer's or give the special tokens other ids: the embedding would be indexed out of range,
    or train the wrong rows. With `init_from` it is the checkpoint's (and the tokenizer must fit its
    embedding). `exits`: with the early exits this run trains (`exit_layers`) recorded."""
    token_ids = token_ids or {}
    if init_from is not None:
        given = {} if section == {"preset": "demo"} else section  # the default: no model section
        cfg = checkpoint_config(init_from, given)
        cfg = with_tokenizer(cfg, init_from, vocab_size, token_ids) if token_ids else cfg
        return with_exits(cfg, exit_layers) if exits else cfg
    model = dict(section)
    base = PRESETS.get(model.pop("preset", None), {})
    v = model.get("vocab_size", vocab_size)
    if not isinstance(v, int) or v < vocab_size:
        raise ConfigError(
            f"model.vocab_size {v!r} is smaller than the tokenizer's vocabulary of {vocab_size}: "
            "drop it (the tokenizer sets it) or make it larger"
        )
    for name, tid in token_ids.items():
        if name in model and model[name] != tid:
            raise ConfigError(
                f"model.{name} {model[name]!r} disagrees with the tokenizer's {tid!r}: drop it (the tokenizer sets it)"
            )
    cfg = ModelConfig.from_dict({**base, "vocab_size": vocab_size, **token_ids, **model})
    return with_exits(cfg, exit_layers) if exits else cfg


def with_exits(cfg: ModelConfig, exit_layers: Sequence[int]) -> ModelConfig:
    """The model config with the early exits this run trains (recorded in the handoff)."""
    if not exit_layers:
        return cfg
    return dataclasses.replace(cfg, early_exit_layers=list(exit_layers))


def checkpoint_config(init_from: str | Path, model_section: dict[str, Any]) -> ModelConfig:
    """The float32 model config of the checkpoint at `init_from`; ConfigError if it is not a float
    checkpoint Baton reads, or if the recipe's model section says anything else than it does."""
    d = Path(init_from)
    if not (d / "config.json").is_file():
        raise ConfigError(f"init_from {d} is not a checkpoint directory (no config.json)")
    try:
        raw = json.loads((d / "config.json").read_text())
        weight_files(d)
    except (json.JSONDecodeError, CheckpointError) as e:
        raise ConfigError(f"init_from {d}: {e}") from e
    if raw.get("quantization_config"):
        raise ConfigError(f"init_from {d} is a quantized checkpoint; fine-tune the float checkpoint it came from")
    cfg = dataclasses.replace(config_from_hf(raw), torch_dtype="float32")
    if "preset" in model_section:
        raise ConfigError("init_from takes the model from the checkpoint: drop model.preset")
    have = cfg.to_dict()
    unknown = sorted(set(model_section) - set(have))
    if unknown:
        raise ConfigError(f"unknown model config key(s): {', '.join(unknown)}")
    differ = {k: (v, have[k]) for k, v in model_section.items() if have[k] != v}
    if differ:
        said = ", ".join(f"model.{k}={v!r} (checkpoint: {c!r})" for k, (v, c) in sorted(differ.items()))
        raise ConfigError(f"init_from {d}: the recipe's model section contradicts the checkpoint: {said}; drop it")
    return cfg


def with_tokenizer(cfg: ModelConfig, init_from: str, vocab_size: int, token_ids: dict[str, Any]) -> ModelConfig:
    """`cfg` with the tokenizer's special token ids (what the data pipeline uses), once the
    tokenizer is known to fit the checkpoint's embedding."""
    if vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"the tokenizer has {vocab_size} tokens but init_from {init_from}'s embedding only "
            f"{cfg.vocab_size}: use the checkpoint's own tokenizer"
        )
    changed = {k: v for k, v in token_ids.items() if getattr(cfg, k) != v}
    if changed:
        log.info("init_from: special token ids from the tokenizer: %s", changed)
    return dataclasses.replace(cfg, **changed)
