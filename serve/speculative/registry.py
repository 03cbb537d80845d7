"""The speculative methods by name: make_proposer builds the Proposer for a SpeculativeConfig, and
check_checkpoint says before any work starts whether the checkpoint has what the method needs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from baton.common.checkpoint import read_config
from baton.common.config import ConfigError
from baton.common.eagle import check_eagle
from baton.common.medusa import CONFIG_FILE, MedusaConfig
from baton.serve.speculative.base import Proposer
from baton.serve.speculative.config import SpeculativeConfig
from baton.serve.speculative.draft import DraftProposer
from baton.serve.speculative.eagle import EagleProposer
from baton.serve.speculative.layerskip import LayerSkipProposer
from baton.serve.speculative.layerskip import check_checkpoint as check_layerskip
from baton.serve.speculative.lookahead import LookaheadProposer
from baton.serve.speculative.medusa import MedusaProposer
from baton.serve.speculative.mtp import MTPProposer, check_mtp
from baton.serve.speculative.ngram import NgramProposer
from baton.serve.speculative.tree import parse_choices


def make_proposer(
    cfg: SpeculativeConfig,
    model_dir: str | Path | None,
    vocab: int,
    device: torch.device,
    dtype: torch.dtype,
    model: torch.nn.Module | None = None,
) -> Proposer:
    """`model`: the engine's own model, when this process holds it (layerskip and mtp draft with it)."""
    cfg.validate()
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if cfg.method == "draft":
        return DraftProposer(cfg, vocab, device, dtype)  # the draft runs where the target runs
    if cfg.method == "lookahead":
        return LookaheadProposer(cfg)
    if cfg.method == "layerskip":
        return LayerSkipProposer(cfg, model, model_dir, device, dtype)
    if cfg.method == "mtp":
        return MTPProposer(cfg, model)
    if cfg.method == "eagle":
        if model_dir is None:
            raise ValueError("EAGLE needs the checkpoint directory holding eagle.safetensors")
        return EagleProposer(cfg, model_dir, device, dtype)
    if model_dir is None:
        raise ValueError("Medusa needs the checkpoint directory holding medusa.safetensors")
    return MedusaProposer(cfg, model_dir, device, dtype)


def check_checkpoint(cfg: SpeculativeConfig, model_dir: str | Path) -> None:
    """Before a server binds its port: what the method needs from the checkpoint (and the draft's)
    is there - Medusa heads deep enough for tree_choices, a draft sharing the target's vocabulary, an
    EAGLE head, a depth for LayerSkip to draft from, MTP modules. Raises ConfigError naming what is missing."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        return  # not a checkpoint: loading it says so
    if cfg.method == "layerskip":
        try:
            check_layerskip(cfg, d)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif cfg.method == "eagle":
        check_eagle(d)
    elif cfg.method == "mtp":
        check_mtp(d)
    elif cfg.method == "medusa":
        if not (d / CONFIG_FILE).is_file():
            raise ConfigError(
                f"--speculative medusa: {d} has no Medusa heads ({CONFIG_FILE}); train them with a medusa recipe"
            )
        heads = MedusaConfig(**json.loads((d / CONFIG_FILE).read_text())).num_heads
        if cfg.tree_choices is not None and max(map(len, parse_choices(cfg.tree_choices))) > heads:
            raise ConfigError(f"tree_choices goes deeper than the checkpoint's {heads} Medusa heads")
    elif cfg.method == "draft":
        draft = Path(cfg.draft_model)
        if not (draft / "config.json").is_file():
            raise ConfigError(f"--draft-model {draft} is not a checkpoint directory (no config.json)")
        target_vocab, draft_vocab = read_config(d).vocab_size, read_config(draft).vocab_size
        if draft_vocab != target_vocab:
            raise ConfigError(
                f"draft model vocab {draft_vocab} != target vocab {target_vocab}: the draft must share the target's tokenizer"
            )
