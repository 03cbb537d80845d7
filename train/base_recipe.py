"""Recipes that train a small module on a frozen handoff checkpoint - Medusa heads, an EAGLE head,
a CoE router: the checks and the parsing they share (one top-level section, maybe `data:`)."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from baton.common.config import ConfigError
from baton.common.data import DataConfig
from baton.train.overrides import apply_overrides, build_section

T = TypeVar("T")


def check_base(section: str, base: str, uses: str) -> None:
    """`base` must be a handoff directory with its tokenizer (`uses`: what the tokenizer is for)."""
    if not (Path(base) / "config.json").is_file():
        raise ValueError(f"{section}.base {base} is not a checkpoint directory (no config.json)")
    if not (Path(base) / "tokenizer.json").is_file():
        raise ValueError(f"{section}.base {base} has no tokenizer.json: {uses}")


def recipe_from_dict(
    raw: dict, overrides: list[str] | tuple[str, ...], section: str, cls: type[T], label: str, data: bool = True
) -> T:
    """{section: {...}} (and `data: {...}` when `data`) as `cls`, checked before any work; every
    problem is a ConfigError naming the recipe kind (`label`, e.g. "a Medusa")."""
    raw = apply_overrides(raw, overrides)
    known = {section, "data"} if data else {section}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) in {label} recipe: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    try:
        fields = dict(raw[section] or {})
        if data:
            fields["data"] = build_section(DataConfig, raw.get("data") or {}, "data")
        return build_section(cls, fields, section)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid {label.split(' ', 1)[1]} recipe: {e}") from e
