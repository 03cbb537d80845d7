"""Medusa heads (Cai et al., 2024): extra decoding heads on the base model's last hidden state.

Head i (0-based) predicts the token i + 2 places ahead of the hidden state's position (the base
LM head predicts the next one). Medusa-1 trains the heads on a frozen base model; the trainer and
the server share this module, and the heads travel inside the handoff checkpoint as
medusa.safetensors + medusa_config.json (transformers ignores both).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from baton.common.checkpoint import save_beside
from safetensors.torch import load_file
from torch import nn

CONFIG_FILE = "medusa_config.json"
WEIGHTS_FILE = "medusa.safetensors"


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 3
    num_layers: int = 1  # residual SiLU blocks per head

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError("Medusa needs num_heads >= 1 and num_layers >= 0")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: the head begins as the LM head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.config = cfg
        self.heads = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)],
                nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False),
            )
            for _ in range(cfg.num_heads)
        )

    def init_from_lm_head(self, lm_head: nn.Linear) -> None:
        with torch.no_grad():
            for head in self.heads:
                head[-1].weight.copy_(lm_head.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [num_heads, ..., vocab]."""
        return torch.stack([head(hidden) for head in self.heads])


def save_medusa(heads: MedusaHeads, directory: str | Path) -> None:
    """Weights first, config last, each via a temporary file and rename (common/checkpoint.py)."""
    save_beside(directory, heads, heads.config, WEIGHTS_FILE, CONFIG_FILE)


def load_medusa(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> MedusaHeads:
    d = Path(directory)
    if not (d / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{d} has no Medusa heads ({CONFIG_FILE}); train them with a medusa recipe")
    heads = MedusaHeads(MedusaConfig(**json.loads((d / CONFIG_FILE).read_text())))
    heads.load_state_dict(load_file(d / WEIGHTS_FILE))
    return heads.to(device=device, dtype=dtype).eval()
