"""LayerSkip self-speculation (Elhoushi et al., 2024): the model's own first E layers draft.

The draft is the target's first E decoder layers, then the shared final norm and LM head (what
LayerSkip training - baton.train.early_exit - teaches to predict); the full model verifies the k
drafted tokens in one pass with the usual rule (decoder.py: greedy identical to plain decoding,
sampling distribution-preserving). No second model is loaded: the draft runs on the very modules
of the engine's model (only a sharded engine, whose process holds no model, loads the checkpoint).

KV: the draft keeps a paged cache for layers < E only (E/L of the target's KV per token), a mirror
of each sequence rolled back after each verification to the prefix it shares with the target (the
DraftProposer machinery, proposers.py), so accepted tokens are never recomputed by the draft. The
verification pass does recompute layers < E for the k proposals: the engine runs every row of a
step from the embedding, and the proposals' rows share that packed forward with other sequences'
prefills and decodes, so it cannot start them at layer E from the draft's states (LayerSkip's
"cache reuse"); at small batch that pass is memory-bound, and k + 1 rows cost little more than one.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from baton.common.config import ModelConfig
from baton.common.model import CausalLM
from baton.serve.block_manager import BlockManager
from baton.serve.model_runner import ModelRunner, kv_block_bytes
from baton.serve.speculative.config import SpeculativeConfig
from baton.serve.speculative.proposers import DraftProposer

BLOCK_SIZE = 16


def exit_layer_for(cfg: SpeculativeConfig, model_config: ModelConfig) -> int:
    """The draft's depth E: `exit_layer` when given, else the checkpoint's first recorded exit."""
    n = model_config.num_hidden_layers
    if model_config.is_hybrid:
        raise ValueError(
            "speculative method 'layerskip' is not for hybrid (Mamba2) models: its draft has no state slots"
        )
    if cfg.exit_layer is None:
        if not model_config.early_exit_layers:
            raise ValueError(
                "speculative method 'layerskip' needs an exit layer: this checkpoint records no early exits "
                "(early_exit_layers in config.json, written by a `baton train` recipe with an early_exit: "
                f"section); pass --exit-layer E (1 <= E < {n}) to draft from its first E layers anyway"
            )
        return model_config.early_exit_layers[0]
    if not 1 <= cfg.exit_layer < n:
        raise ValueError(f"exit_layer must be in 1..{n - 1} (the model has {n} layers), got {cfg.exit_layer}")
    return cfg.exit_layer


def check_checkpoint(cfg: SpeculativeConfig, model_dir: str | Path) -> None:
    """Before a server binds its port: the checkpoint's config.json gives the draft a depth."""
    from baton.common.checkpoint import read_config

    if (Path(model_dir) / "config.json").is_file():
        exit_layer_for(cfg, read_config(model_dir))


class LayerSkipProposer(DraftProposer):
    """A DraftProposer whose draft is the target's first E layers (module docstring)."""

    def __init__(
        self,
        cfg: SpeculativeConfig,
        model: CausalLM | None,
        model_dir: str | Path | None,
        device: torch.device,
        dtype: torch.dtype,
    ):
        if model is None:  # a sharded engine: this process holds no model, so load it (only E layers run)
            from baton.common.checkpoint import load_checkpoint

            if model_dir is None:
                raise ValueError("speculative method 'layerskip' needs the model or its checkpoint directory")
            model = load_checkpoint(model_dir, device=device, dtype=dtype if dtype.is_floating_point else None).model
        self.cfg = cfg
        self.exit_layer = exit_layer_for(cfg, model.config)
        p = next(model.parameters())
        block_bytes = kv_block_bytes(model, BLOCK_SIZE, p.dtype, num_layers=self.exit_layer)
        num_blocks = max(4, cfg.draft_kv_cache_bytes // block_bytes)
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
        self.runner = ModelRunner(model, num_blocks, BLOCK_SIZE, layers=range(self.exit_layer))
        self.mirrors = {}
        self._ids = itertools.count()
