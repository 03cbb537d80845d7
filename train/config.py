"""Training recipe: dataclasses loaded from YAML (+ key=value overrides), validated up front.

Everything that can be wrong with a recipe (unknown keys, impossible batch arithmetic, missing
data) raises a ConfigError before a single weight is allocated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from baton.common.config import PRESETS, ConfigError, ModelConfig
from baton.train.data import DataConfig


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5  # cosine decays from lr to min_lr
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class TokenizerConfig:
    path: str | None = None  # a directory with tokenizer.json; None: train one on the data
    kind: str = "bpe"  # "bpe" (byte-level) or "char", when training one
    vocab_size: int = 1024  # for "bpe"


@dataclass
class TrainConfig:
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "demo"})
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    global_batch_size: int | None = None  # if set, must equal micro * accum * data-parallel size
    max_steps: int = 1000
    eval_interval: int = 100
    eval_batches: int = 8
    log_interval: int = 10
    out_dir: str = "runs/default"
    seed: int = 1234

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, data_parallel_size: int = 1) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"invalid training config: {msg}")

        for name in ("micro_batch_size", "grad_accum_steps", "max_steps", "eval_batches", "log_interval"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
        need(isinstance(self.eval_interval, int) and self.eval_interval >= 0, "eval_interval must be >= 0 (0: only at the end)")
        per_step = self.micro_batch_size * self.grad_accum_steps * data_parallel_size
        if self.global_batch_size is not None:
            need(self.global_batch_size == per_step,
                 f"global_batch_size {self.global_batch_size} != micro_batch_size {self.micro_batch_size} x "
                 f"grad_accum_steps {self.grad_accum_steps} x data-parallel size {data_parallel_size} = {per_step}")
        o = self.optim
        need(o.lr > 0 and 0 <= o.min_lr <= o.lr, f"need 0 <= min_lr ({o.min_lr}) <= lr ({o.lr}) and lr > 0")
        need(0 <= o.warmup_steps <= self.max_steps, f"warmup_steps {o.warmup_steps} must be in 0..max_steps {self.max_steps}")
        need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "betas must be in [0, 1)")
        need(o.grad_clip >= 0 and o.weight_decay >= 0, "grad_clip and weight_decay must be >= 0")
        need(self.tokenizer.kind in ("bpe", "char"), f"tokenizer.kind must be 'bpe' or 'char', got {self.tokenizer.kind!r}")
        need(self.tokenizer.vocab_size >= 260 or self.tokenizer.kind == "char",
             "tokenizer.vocab_size must be >= 260 for byte-level BPE (256 bytes + specials)")
        if self.tokenizer.path is not None:
            need((Path(self.tokenizer.path) / "tokenizer.json").is_file(),
                 f"tokenizer.path {self.tokenizer.path} has no tokenizer.json")
        model = dict(self.model)
        name = model.pop("preset", None)
        need(name is None or name in PRESETS, f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        self.model_config(vocab_size=model.get("vocab_size", 1024))  # raises on a bad model section
        max_pos = {**PRESETS.get(name, {}), **model}.get("max_position_embeddings", 2048)
        need(self.data.seq_len <= max_pos, f"data.seq_len {self.data.seq_len} exceeds the model's max_position_embeddings {max_pos}")

    def model_config(self, vocab_size: int, **token_ids: Any) -> ModelConfig:
        """The model config; vocab size and special token ids come from the tokenizer."""
        model = dict(self.model)
        base = PRESETS.get(model.pop("preset", None), {})
        return ModelConfig.from_dict({**base, "vocab_size": vocab_size, **token_ids, **model})


_SECTIONS = {"data": DataConfig, "tokenizer": TokenizerConfig, "optim": OptimConfig}


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
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


def config_from_dict(raw: dict[str, Any], overrides: list[str] = ()) -> TrainConfig:
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. optim.lr=1e-3)")
        key, value = item.split("=", 1)
        _set(raw, key.strip(), yaml.safe_load(value))
    top = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise ConfigError(f"unknown key(s) in training config: {', '.join(unknown)} (known: {', '.join(sorted(top))})")
    try:
        sections = {k: _build(cls, raw.pop(k) or {}, k) for k, cls in _SECTIONS.items() if k in raw}
        return TrainConfig(**raw, **sections)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e


def load_config(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"training config {path} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a YAML mapping at the top level")
    return config_from_dict(raw, overrides)
