"""A prompt router for a Composition of Experts: which whole model should answer this prompt.

The prompt is embedded by a frozen small model (a handoff checkpoint: the mean of its last hidden
states over the prompt's tokens), then either a linear classifier on the standardised embedding
(RouteLLM-style) or a k-nearest-neighbour vote among labelled embeddings (Samba-CoE's way) says
which expert, with a confidence in [0, 1] (the classifier's softmax, or the share of the k votes).
The trainer (train/router.py) and the server (serve/coe/) share this module; a router travels as
router.safetensors + router_config.json in its own directory.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from baton.common.checkpoint import load_checkpoint, save_beside
from baton.common.model import CausalLM
from baton.common.tokenizer import Tokenizer
from safetensors.torch import load_file
from torch import nn

CONFIG_FILE = "router_config.json"
WEIGHTS_FILE = "router.safetensors"
KINDS = ("classifier", "knn")


@dataclass
class RouterConfig:
    base: str  # handoff checkpoint whose frozen hidden states embed the prompts
    experts: list[str]  # class index -> expert name
    hidden_size: int
    kind: str = "classifier"
    k: int = 5  # knn: neighbours that vote
    max_tokens: int = 128  # prompt tokens embedded (the first ones)
    train_accuracy: float | None = None  # as measured when trained (informational)
    val_accuracy: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"router kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.experts) < 2 or len(set(self.experts)) != len(self.experts):
            raise ValueError(f"a router needs at least two distinct experts, got {self.experts}")
        if self.k < 1 or self.max_tokens < 1:
            raise ValueError("router k and max_tokens must be >= 1")


class RouterHead(nn.Module):
    """Embedding -> probabilities over experts. Standardisation statistics are buffers, so the
    classifier and the kNN bank see embeddings on the scale they were fitted on."""

    def __init__(self, cfg: RouterConfig, bank_size: int = 0):
        super().__init__()
        self.config = cfg
        h, e = cfg.hidden_size, len(cfg.experts)
        self.register_buffer("mean", torch.zeros(h))
        self.register_buffer("std", torch.ones(h))
        if cfg.kind == "classifier":
            self.linear = nn.Linear(h, e)
        else:
            self.register_buffer("bank", torch.zeros(bank_size, h))  # unit-norm standardised embeddings
            self.register_buffer("labels", torch.zeros(bank_size, dtype=torch.long))

    def standardise(self, emb: torch.Tensor) -> torch.Tensor:
        return (emb.float() - self.mean) / self.std

    def fit_statistics(self, emb: torch.Tensor) -> None:
        self.mean.copy_(emb.float().mean(0))
        self.std.copy_(emb.float().std(0).clamp_min(1e-6))

    def logits(self, emb: torch.Tensor) -> torch.Tensor:
        """Classifier logits [B, E] (the training objective's input)."""
        return self.linear(self.standardise(emb))

    def probs(self, emb: torch.Tensor) -> torch.Tensor:
        if self.config.kind == "classifier":
            return F.softmax(self.logits(emb), dim=-1)
        sims = F.normalize(self.standardise(emb), dim=-1) @ self.bank.T  # cosine similarity [B, N]
        k = min(self.config.k, self.bank.shape[0])
        votes = self.labels[sims.topk(k, dim=-1).indices]  # [B, k]
        return F.one_hot(votes, len(self.config.experts)).float().mean(1)


@torch.no_grad()
def embed(model: CausalLM, tok: Tokenizer, texts: Sequence[str], max_tokens: int, batch_size: int = 32) -> torch.Tensor:
    """Mean-pooled last hidden states [len(texts), H], in float32. Prompts are right-padded: with
    causal attention the padding after a prompt cannot change its positions' states."""
    device = next(model.parameters()).device
    out = []
    ids = [(t or [0])[:max_tokens] for t in tok.encode_batch(list(texts))]
    for i in range(0, len(ids), batch_size):
        chunk = ids[i : i + batch_size]
        width = max(map(len, chunk))
        batch = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(chunk), width, 1, device=device)
        for row, t in enumerate(chunk):
            batch[row, : len(t)] = torch.tensor(t, device=device)
            mask[row, : len(t)] = 1.0
        hidden = model.hidden(batch).float()
        out.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(out)


class Router:
    """Base model + head: `route(texts)` -> (expert, confidence) per text."""

    def __init__(self, model: CausalLM, tok: Tokenizer, head: RouterHead):
        self.model, self.tok, self.head = model.eval(), tok, head.eval()
        self.config = head.config

    def probabilities(self, texts: Sequence[str]) -> torch.Tensor:
        emb = embed(self.model, self.tok, texts, self.config.max_tokens)
        with torch.no_grad():
            return self.head.to(emb.device).probs(emb)

    def route(self, texts: Sequence[str]) -> list[tuple[str, float]]:
        conf, idx = self.probabilities(texts).max(-1)
        return [(self.config.experts[i], c) for i, c in zip(idx.tolist(), conf.tolist())]


def load_base(base: str | Path, device: torch.device | str = "cpu") -> tuple[CausalLM, Tokenizer]:
    """The frozen embedding model and its tokenizer."""
    if not (Path(base) / "tokenizer.json").is_file():
        raise ValueError(f"router base {base} has no tokenizer.json: the router embeds text with it")
    model = load_checkpoint(base, device=device, dtype=torch.float32).model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, Tokenizer.from_dir(base)


def save_router(head: RouterHead, directory: str | Path) -> Path:
    """Weights first, config last, each via a temporary file and rename (common/checkpoint.py)."""
    save_beside(directory, head, head.config, WEIGHTS_FILE, CONFIG_FILE)
    return Path(directory)


def read_router_config(directory: str | Path) -> RouterConfig:
    d = Path(directory)
    if not (d / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{d} has no router ({CONFIG_FILE}); train one with a `router:` recipe")
    return RouterConfig(**json.loads((d / CONFIG_FILE).read_text()))


def load_router(directory: str | Path, device: torch.device | str = "cpu", base: str | None = None) -> Router:
    """The router in `directory`; `base` overrides the embedding checkpoint's recorded path."""
    cfg = read_router_config(directory)
    weights = load_file(Path(directory) / WEIGHTS_FILE)
    head = RouterHead(cfg, bank_size=weights["bank"].shape[0] if "bank" in weights else 0)
    head.load_state_dict(weights)
    model, tok = load_base(base or cfg.base, device)
    if model.config.hidden_size != cfg.hidden_size:
        raise ValueError(
            f"router base {base or cfg.base} has hidden size {model.config.hidden_size}; "
            f"the router was trained on {cfg.hidden_size}"
        )
    return Router(model, tok, head.to(device))
