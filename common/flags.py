"""Command-line flags derived from config dataclasses, so every option is reachable without a
hand-written flag for each (a new field in EngineConfig is a new `baton serve` flag).

A derived flag is `--<prefix><field>` with dashes, typed from the annotation, defaulting to None
("the dataclass's own default"), so only what the user gave overrides the config. Fields that
already have a hand-written flag with a better name or unit (e.g. `--kv-cache-mb`) are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

SCALARS = (int, float, str, bool)


def _scalar_type(hint: Any) -> type | None:
    """int / float / str / bool for `T` or `T | None`; None for anything else (lists, dataclasses)."""
    if hint in SCALARS:
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and args[0] in SCALARS:
            return args[0]
    return None


def _defined(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions}


def add_dataclass_flags(
    parser: argparse.ArgumentParser, cls: type, prefix: str = "", skip: tuple[str, ...] = (), group: str | None = None
) -> None:
    """One flag per scalar field of `cls` whose destination the parser does not define yet."""
    hints = typing.get_type_hints(cls)
    target = parser.add_argument_group(group or cls.__name__) if group is not False else parser
    defined = _defined(parser)
    for f in dataclasses.fields(cls):
        typ, dest = _scalar_type(hints[f.name]), prefix + f.name
        if typ is None or f.name in skip or dest in defined:
            continue
        default = f.default if f.default is not dataclasses.MISSING else "required"
        flag = "--" + dest.replace("_", "-")
        if typ is bool:
            target.add_argument(
                flag,
                dest=dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{cls.__name__}.{f.name} (default: {default})",
            )
        else:
            target.add_argument(
                flag,
                dest=dest,
                type=typ,
                default=None,
                metavar=typ.__name__.upper(),
                help=f"{cls.__name__}.{f.name} (default: {default})",
            )


def dataclass_from_flags(
    cls: type, args: argparse.Namespace, prefix: str = "", aliases: dict[str, str] | None = None, **given: Any
) -> Any:
    """`cls(**given, **every scalar field the flags set)`. `aliases` maps a field to a hand-written
    flag's destination (e.g. num_speculative_tokens for SpeculativeConfig)."""
    aliases = aliases or {}
    kwargs = dict(given)
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            continue
        value = getattr(args, aliases.get(f.name, prefix + f.name), None)
        if value is not None:
            kwargs[f.name] = value
    return cls(**kwargs)
