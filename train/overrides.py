"""Raw recipes (YAML mappings) before they become dataclasses: dotted key=value overrides, and a
section built from its mapping with unknown keys refused by name.

Shared by every kind of recipe (baton.train.recipe for model recipes, baton.train.base_recipe for
Medusa, EAGLE and router recipes); knows nothing about what the sections mean.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import yaml
from baton.common.config import ConfigError

_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def build_section(cls: type, raw: dict[str, Any], where: str) -> Any:
    """`raw` (the recipe's `where` section) as the dataclass `cls`; its own checks run on construction."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) in {where}: {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    return cls(**raw)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = tree.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
        tree = node
    tree[leaf] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A copy of the recipe with each dotted key=value override (a YAML value) set."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. optim.lr=1e-3)")
        key, value = item.split("=", 1)
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str) and _EXPONENT.fullmatch(value.strip()):
            parsed = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        _set(raw, key.strip(), parsed)
    return raw
