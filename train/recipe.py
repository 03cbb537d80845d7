"""Reading a recipe: YAML (+ dotted key=value overrides) into a checked TrainConfig - or, for a
recipe with a `medusa:`, `eagle:` or `router:` section, that kind of recipe's own config.

Every check (baton.train.validate) runs here, before anything is built: a bad recipe is a
ConfigError naming the key. The recipe keys that moved are read at their new place here:
megatron.tp/pp/vp/sequence_parallel are parallel.tp/pp/pp_stages_per_rank/sequence_parallel.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import yaml
from baton.common.config import ConfigError
from baton.common.data import DataConfig
from baton.train.config import (
    CheckpointConfig,
    DeepSpeedConfig,
    LoggingConfig,
    LossScaleConfig,
    MegatronConfig,
    MoEConfig,
    OptimConfig,
    RecomputeConfig,
    TokenizerConfig,
    TrainConfig,
)
from baton.train.early_exit import EarlyExitConfig
from baton.train.mtp import MTPConfig
from baton.train.overrides import apply_overrides, build_section
from baton.train.parallel.layout import ParallelConfig
from baton.train.validate import validate

log = logging.getLogger(__name__)

SECTIONS = {
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "optim": OptimConfig,
    "loss_scale": LossScaleConfig,
    "deepspeed": DeepSpeedConfig,
    "recompute": RecomputeConfig,
    "moe": MoEConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "parallel": ParallelConfig,
    "megatron": MegatronConfig,
    "early_exit": EarlyExitConfig,
    "mtp": MTPConfig,
}
# megatron.<key> -> parallel.<key>: backend megatron's layout was its own section's before the
# parallel section served every backend; recipes that still say so keep their meaning.
MEGATRON_LAYOUT_KEYS = {"tp": "tp", "pp": "pp", "vp": "pp_stages_per_rank", "sequence_parallel": "sequence_parallel"}


def config_from_dict(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The recipe `raw` with `overrides` applied, as a TrainConfig that passed every check."""
    raw = megatron_layout_keys(apply_overrides(raw, overrides))
    top = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise ConfigError(f"unknown key(s) in training config: {', '.join(unknown)} (known: {', '.join(sorted(top))})")
    try:
        sections = {k: build_section(cls, raw.pop(k) or {}, k) for k, cls in SECTIONS.items() if k in raw}
        cfg = TrainConfig(**raw, **sections)
        validate(cfg)
        return cfg
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e


def megatron_layout_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the deprecated megatron.tp / pp / vp / sequence_parallel moved to the parallel
    section (vp is parallel.pp_stages_per_rank, with pp_schedule interleaved_1f1b), meaning what
    they did: sequence parallelism stays off unless one of the two sections turns it on. Refused:
    the keys without backend megatron, and a key whose parallel counterpart says otherwise."""
    section, layout = raw.get("megatron"), raw.get("parallel")
    if not isinstance(section, dict) or not (used := [k for k in MEGATRON_LAYOUT_KEYS if k in section]):
        return raw
    if layout is None:
        layout = {}
    if not isinstance(layout, dict):
        return raw  # building the parallel section says what is wrong with it
    backend = raw.get("backend", "torch")
    if backend != "megatron":
        raise ConfigError(
            f"invalid training config: megatron.{', megatron.'.join(used)} set, but backend is {backend!r}: "
            "the megatron section needs backend: megatron"
        )
    section, layout = dict(section), dict(layout)
    for key in used:
        new, value = MEGATRON_LAYOUT_KEYS[key], section.pop(key)
        if new in layout and layout[new] != value:
            raise ConfigError(
                f"invalid training config: megatron.{key} {value!r} and parallel.{new} {layout[new]!r} disagree; "
                f"megatron.{key} is the old name of parallel.{new} (one layout section serves every backend): "
                f"drop megatron.{key}"
            )
        layout[new] = value
        log.warning("recipe key megatron.%s is deprecated: read as parallel.%s", key, new)
    if isinstance(layout.get("pp_stages_per_rank"), int) and layout["pp_stages_per_rank"] > 1:
        layout.setdefault("pp_schedule", "interleaved_1f1b")  # megatron's vp > 1: its interleaved 1F1B
    layout.setdefault("sequence_parallel", False)  # the megatron section's default
    return {**raw, "megatron": section, "parallel": layout}


def read_recipe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"training config {path} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a YAML mapping at the top level")
    return raw


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    return config_from_dict(read_recipe(path), overrides)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """What `baton train` runs: a model recipe (TrainConfig), or - when the recipe has a top-level
    `medusa:` section - Medusa heads for a frozen handoff checkpoint (MedusaTrainConfig), or - with
    a `router:` section - a Composition-of-Experts prompt router (RouterTrainConfig), or - with an
    `eagle:` section - an EAGLE draft head for a frozen handoff checkpoint (EagleTrainConfig)."""
    raw = read_recipe(path)
    if "eagle" in raw:
        from baton.train.eagle import eagle_config_from_dict

        return eagle_config_from_dict(raw, overrides)
    if "medusa" in raw:
        from baton.train.medusa import medusa_config_from_dict

        return medusa_config_from_dict(raw, overrides)
    if "router" in raw:
        from baton.train.router import router_config_from_dict

        return router_config_from_dict(raw, overrides)
    return config_from_dict(raw, overrides)
