"""Train a Composition-of-Experts prompt router (common/router.py) from labelled prompts.

Data: JSONL lines {"text": ..., "expert": ...}. Every prompt is embedded once by the frozen base
(a small handoff checkpoint), so training touches only the head: a linear classifier fitted
full-batch with AdamW on the standardised embeddings, or (kind: knn) the embeddings themselves
kept as the neighbour bank. Held-out accuracy (val_path, else a val_fraction split) is logged and
recorded in router_config.json. `baton train` runs this for a recipe with a top-level `router:`
section (configs/router-demo.yaml); `baton serve --coe` reads the result.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from baton.common.router import KINDS, RouterConfig, RouterHead, embed, load_base, save_router
from baton.train.base_recipe import check_base, recipe_from_dict

log = logging.getLogger(__name__)


def read_labelled(path: str | Path) -> list[tuple[str, str]]:
    """(text, expert) pairs; ValueError naming the line of a malformed one."""
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not isinstance(row.get("expert"), str):
            raise ValueError(f'{path}:{n}: each line must be {{"text": "...", "expert": "..."}}')
        if not row["text"]:
            raise ValueError(f"{path}:{n}: empty text")
        pairs.append((row["text"], row["expert"]))
    return pairs


@dataclass
class RouterTrainConfig:
    base: str  # handoff checkpoint whose frozen hidden states embed the prompts
    data: str  # JSONL {"text", "expert"}
    out: str  # the router's directory
    kind: str = "classifier"  # or "knn"
    val_path: str | None = None  # held-out JSONL; else val_fraction of `data`
    val_fraction: float = 0.2
    steps: int = 300  # full-batch optimiser steps (classifier)
    lr: float = 1e-2
    weight_decay: float = 1e-3
    k: int = 5
    max_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        check_base("router", self.base, "the router embeds text with it")
        for name in ("data", "val_path"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"router.{name} {path} does not exist")
        if self.kind not in KINDS:
            raise ValueError(f"router.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not 0 <= self.val_fraction < 1 or self.steps < 1 or self.lr <= 0 or self.k < 1 or self.max_tokens < 1:
            raise ValueError("router needs 0 <= val_fraction < 1, steps >= 1, lr > 0, k >= 1 and max_tokens >= 1")
        labels = {e for _, e in read_labelled(self.data)}
        if len(labels) < 2:
            raise ValueError(f"router.data {self.data} names {len(labels)} expert(s); a router needs at least two")


def router_config_from_dict(raw: dict, overrides: list[str] | tuple[str, ...] = ()) -> RouterTrainConfig:
    """A `baton train` recipe {router: {base, data, out, ...}}, checked before any work."""
    return recipe_from_dict(raw, overrides, "router", RouterTrainConfig, "a router", data=False)


def _split(cfg: RouterTrainConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    pairs = read_labelled(cfg.data)
    if cfg.val_path is not None:
        return pairs, read_labelled(cfg.val_path)
    random.Random(cfg.seed).shuffle(pairs)
    n_val = int(len(pairs) * cfg.val_fraction)
    return pairs[n_val:], pairs[:n_val]


def accuracy(head: RouterHead, emb: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (head.probs(emb).argmax(-1) == labels).float().mean().item() if len(labels) else float("nan")


def train_router(cfg: RouterTrainConfig) -> RouterHead:
    """Fit, report accuracy, write the router into cfg.out; returns the head."""
    torch.manual_seed(cfg.seed)
    train, val = _split(cfg)
    experts = sorted({e for _, e in train})
    unseen = sorted({e for _, e in val} - set(experts))
    if unseen:
        raise ValueError(f"held-out prompts name experts with no training prompt: {', '.join(unseen)}")
    model, tok = load_base(cfg.base)
    emb = embed(model, tok, [t for t, _ in train], cfg.max_tokens)
    val_emb = embed(model, tok, [t for t, _ in val], cfg.max_tokens) if val else emb[:0]
    labels = torch.tensor([experts.index(e) for _, e in train])
    val_labels = torch.tensor([experts.index(e) for _, e in val], dtype=torch.long)
    rc = RouterConfig(cfg.base, experts, model.config.hidden_size, cfg.kind, cfg.k, cfg.max_tokens)
    head = RouterHead(rc, bank_size=len(train) if cfg.kind == "knn" else 0)
    head.fit_statistics(emb)
    if cfg.kind == "knn":
        with torch.no_grad():
            head.bank.copy_(F.normalize(head.standardise(emb), dim=-1))
            head.labels.copy_(labels)
    else:
        opt = torch.optim.AdamW(head.linear.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        for _ in range(cfg.steps):
            loss = F.cross_entropy(head.logits(emb), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        log.info("router classifier: final train loss %.4f", loss.item())
    rc.train_accuracy, rc.val_accuracy = accuracy(head, emb, labels), accuracy(head, val_emb, val_labels)
    log.info(
        "router (%s over %s): %d experts, train accuracy %.3f on %d prompts, held-out %.3f on %d",
        cfg.kind,
        cfg.base,
        len(experts),
        rc.train_accuracy,
        len(train),
        rc.val_accuracy,
        len(val),
    )
    save_router(head, cfg.out)
    return head
