"""Sampling parameters from the wire (protobuf or Triton's JSON) into the engine's SamplingParams.

Both paths end in SamplingParams.validate, so a bad value gets the engine's own message, which
names the field. Unknown JSON keys and wrongly typed values are refused here, by name. The wire
admits what validate must refuse: NaN/inf doubles (and "nan" strings, and JSON's 1e400, which
parses as inf), ints past int64 in JSON, integral floats past any int field's range.
"""

from __future__ import annotations

import dataclasses
import json
import typing

from baton.serve.core.structured import StructuredOutputs
from baton.serve.rpc import invalid
from baton.serve.sampling_params import SamplingParams, Thinking
from google.protobuf.message import Message

_HINTS = typing.get_type_hints(SamplingParams)
_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_STRUCTURED = {f.name for f in dataclasses.fields(StructuredOutputs)}
_THINKING = {f.name for f in dataclasses.fields(Thinking)}


def _checked(kwargs: dict, where: str) -> SamplingParams:
    params = SamplingParams(**kwargs)
    try:
        params.validate()
    except ValueError as e:
        raise invalid(f"{where}: {e}") from None
    return params


def from_proto(msg: Message) -> SamplingParams:
    """Set fields only: an unset optional keeps the engine's default."""
    kwargs = {f.name: list(v) if f.name in ("stop", "stop_token_ids") else v for f, v in msg.ListFields()}
    if "structured" in kwargs:  # a oneof: the kind set on the wire, or none (refused by validate)
        kwargs["structured"] = StructuredOutputs(**{f.name: v for f, v in kwargs["structured"].ListFields()})
    return _checked(kwargs, "sampling")


def _structured(value) -> StructuredOutputs:
    """sampling_parameters.structured: {"json": schema (object or its text) | "json_object": true |
    "regex": str | "grammar": str}."""
    if not isinstance(value, dict):
        raise invalid(f"sampling_parameters.structured must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - _STRUCTURED)
    if unknown:
        raise invalid(
            f"sampling_parameters.structured: unknown field {unknown[0]!r} (known: {', '.join(sorted(_STRUCTURED))})"
        )
    return StructuredOutputs(**value)


def _thinking(value) -> Thinking:
    """sampling_parameters.thinking: {"end_token_ids": [int, ...], "budget": int | null, "in_thinking": bool}
    (types are checked by SamplingParams.validate, which names the field)."""
    if not isinstance(value, dict):
        raise invalid(f"sampling_parameters.thinking must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - _THINKING)
    if unknown or "end_token_ids" not in value:
        what = f"unknown field {unknown[0]!r}" if unknown else "end_token_ids is required"
        raise invalid(f"sampling_parameters.thinking: {what} (known: {', '.join(sorted(_THINKING))})")
    return Thinking(**value)


def _coerce(key: str, value):
    """JSON value -> the field's type. Triton clients often send numbers as strings: accept those."""
    hint = _HINTS[key]
    optional = type(None) in typing.get_args(hint)  # X | None (list[str]'s args are not Optional's)
    base = next(t for t in typing.get_args(hint) if t is not type(None)) if optional else hint
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        if not isinstance(value, list):
            value = [value]
        return [_scalar(key, v, item) for v in value]
    if value is None and optional:
        return None
    return _scalar(key, value, base)


def _scalar(key: str, value, typ: type):
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif typ is float:
        try:
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                return float(value)  # "nan", "inf" and 1e400 (parsed as inf) are left to validate
        except (ValueError, OverflowError):  # not a number, or an int past float's range
            pass
    elif typ is str and isinstance(value, str):
        return value
    raise invalid(f"sampling_parameters.{key}: expected {typ.__name__}, got {value!r}")


def from_json(text: str) -> SamplingParams:
    """Triton's `sampling_parameters` input: a JSON object of vLLM-named fields."""
    try:
        obj = json.loads(text) if text.strip() else {}
    except ValueError as e:  # JSONDecodeError, or an integer literal past Python's 4300-digit limit
        raise invalid(f"sampling_parameters is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise invalid(f"sampling_parameters must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise invalid(f"sampling_parameters: unknown field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
    special = {"structured": _structured, "thinking": _thinking}
    kwargs = {k: special[k](v) if k in special else _coerce(k, v) for k, v in obj.items()}
    return _checked(kwargs, "sampling_parameters")
