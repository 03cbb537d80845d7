"""The `baton serve --coe COE.yaml` file: experts, their KV-cache shares, the router, the fallback.

    name: coe                    # the model name that asks the router (default: the file's stem)
    kv_cache_mb: 256             # the whole KV budget (default: --kv-cache-mb)
    fallback: generalist         # serves prompts the router is unsure of (default: the first expert)
    router:                      # optional; without it the CoE name always means the fallback
      path: runs/router          # written by `baton train` with a router: recipe
      threshold: 0.6             # confidence below which the fallback serves
      base: null                 # override the router's embedding checkpoint path
    experts:
      - {name: generalist, checkpoint: runs/demo/handoff}
      - {name: poet, checkpoint: runs/tinyshakespeare/handoff, kv_cache_mb: 64}

An expert without kv_cache_mb gets a share of what the stated ones leave, in proportion to its
KV bytes per token, so every such expert can cache the same number of tokens. Everything is
checked here, before a port is bound: a ConfigError names the first problem.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml
from baton.common.checkpoint import read_config
from baton.common.config import ConfigError
from baton.common.router import read_router_config

MB = 2**20


@dataclass
class ExpertSpec:
    name: str
    checkpoint: str
    kv_cache_mb: float | None = None  # its share of the budget; None: split by size
    kv_cache_bytes: int = 0  # resolved share (filled by resolve_budgets)


@dataclass
class RouterSpec:
    path: str
    threshold: float = 0.5
    base: str | None = None


@dataclass
class CoEConfig:
    name: str
    experts: list[ExpertSpec]
    fallback: str
    kv_cache_bytes: int
    router: RouterSpec | None = None
    source: str = ""  # the YAML file

    def expert(self, name: str) -> ExpertSpec | None:
        return next((e for e in self.experts if e.name == name), None)


def kv_bytes_per_token(checkpoint: str | Path) -> int:
    """What the KV cache holds for one token over every attention layer, in the checkpoint's dtype:
    K and V per KV head, or an MLA layer's one latent row (kv_lora_rank + qk_rope_head_dim)."""
    cfg = read_config(checkpoint)
    elem = {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(cfg.dtype).removeprefix("torch."), 4)
    layers = sum(cfg.is_attention_layer(i) for i in range(cfg.num_hidden_layers))
    per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.is_mla else 2 * cfg.num_key_value_heads * cfg.head_dim
    return layers * per_layer * elem


def check_expert(spec: ExpertSpec, taken: set[str], coe_name: str) -> None:
    """One expert's own problems (also run for an expert added at run time)."""
    if not isinstance(spec.name, str) or not spec.name:
        raise ConfigError("every expert needs a non-empty name")
    if spec.name in taken:
        raise ConfigError(f"expert name {spec.name!r} is used twice")
    if spec.name == coe_name:
        raise ConfigError(f"expert name {spec.name!r} is the CoE's own name (which asks the router)")
    if not (Path(spec.checkpoint) / "config.json").is_file():
        raise ConfigError(f"expert {spec.name!r}: checkpoint {spec.checkpoint} is not a checkpoint directory")
    if spec.kv_cache_mb is not None and spec.kv_cache_mb <= 0:
        raise ConfigError(f"expert {spec.name!r}: kv_cache_mb must be > 0, got {spec.kv_cache_mb}")


def resolve_budgets(experts: list[ExpertSpec], total: int) -> None:
    """Fill kv_cache_bytes: stated shares as given, the rest split by KV bytes per token."""
    stated = sum(int(e.kv_cache_mb * MB) for e in experts if e.kv_cache_mb is not None)
    if stated > total:
        raise ConfigError(
            f"the experts' kv_cache_mb add up to {stated / MB:g} MB, over the KV budget of {total / MB:g} MB"
        )
    rest = [e for e in experts if e.kv_cache_mb is None]
    weights = {e.name: kv_bytes_per_token(e.checkpoint) for e in rest}
    for e in experts:
        if e.kv_cache_mb is not None:
            e.kv_cache_bytes = int(e.kv_cache_mb * MB)
        else:
            e.kv_cache_bytes = (total - stated) * weights[e.name] // sum(weights.values())
            if e.kv_cache_bytes < MB // 16:
                raise ConfigError(
                    f"expert {e.name!r} would get {e.kv_cache_bytes} bytes of KV cache: the stated shares "
                    f"leave {(total - stated) / MB:g} MB of {total / MB:g} MB; raise kv_cache_mb or state its share"
                )


def _section(raw, cls, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    names = {f.name for f in dataclasses.fields(cls)} - {"kv_cache_bytes"}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) in {where}: {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    try:
        return cls(**raw)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_coe_config(path: str | Path, default_kv_cache_bytes: int | None) -> CoEConfig:
    """Parse and check COE.yaml; `default_kv_cache_bytes` is --kv-cache-mb's (None on CUDA)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"CoE file {path} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a YAML mapping")
    known = {"name", "kv_cache_mb", "fallback", "router", "experts"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) in {path}: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    name = str(raw.get("name") or path.stem)
    items = raw.get("experts")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path}: experts must be a non-empty list of {{name, checkpoint}}")
    experts: list[ExpertSpec] = []
    for i, item in enumerate(items):
        spec = _section(item, ExpertSpec, f"experts[{i}]")
        check_expert(spec, {e.name for e in experts}, name)
        experts.append(spec)
    total = int(raw["kv_cache_mb"] * MB) if raw.get("kv_cache_mb") is not None else default_kv_cache_bytes
    if total is None:
        raise ConfigError(f"{path}: set kv_cache_mb (the KV budget all experts share) or --kv-cache-mb")
    if total <= 0:
        raise ConfigError(f"{path}: kv_cache_mb must be > 0")
    resolve_budgets(experts, total)
    names = [e.name for e in experts]
    fallback = raw.get("fallback") or names[0]
    if fallback not in names:
        raise ConfigError(f"fallback {fallback!r} is not an expert ({', '.join(names)})")
    router = None
    if raw.get("router") is not None:
        router = _section(raw["router"], RouterSpec, "router")
        _check_router(router, names)
    return CoEConfig(name, experts, fallback, total, router, str(path))


def _check_router(spec: RouterSpec, names: list[str]) -> None:
    if not 0 <= spec.threshold <= 1:
        raise ConfigError(f"router.threshold must be in [0, 1], got {spec.threshold}")
    try:
        rc = read_router_config(spec.path)
    except (FileNotFoundError, TypeError, ValueError) as e:
        raise ConfigError(f"router.path: {e}") from None
    base = spec.base or rc.base
    if not (Path(base) / "config.json").is_file():
        raise ConfigError(f"the router's embedding checkpoint {base} is missing (set router.base)")
    unknown = sorted(set(rc.experts) - set(names))
    if unknown:
        raise ConfigError(
            f"the router at {spec.path} chooses among {', '.join(rc.experts)}, but {', '.join(unknown)} "
            f"is not an expert here ({', '.join(names)})"
        )
