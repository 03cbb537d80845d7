"""Medusa-1: train Medusa heads on a frozen base model, from a corpus (`data:`).

Head k (0-based) learns to predict the token k + 2 places after each position from the base's
last hidden state; the losses are summed with Medusa's decay (0.8^k). At decode time the heads
must guess the base's tokens, not the corpus's, so they learn best from the base's own
continuations (Medusa's self-distillation, section 3.2): run `baton distill` on the base first
and point data.path at the file it writes, as for a draft model. The heads are written into the
base's handoff directory (medusa.safetensors + medusa_config.json), where the server finds them
(`baton serve --speculative medusa`). `baton train` runs this for a recipe with a top-level
`medusa:` section (configs/demo-medusa.yaml).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from baton.common.checkpoint import load_checkpoint
from baton.common.data import DataConfig, build_datasets, torch_loader
from baton.common.medusa import MedusaConfig, MedusaHeads, save_medusa
from baton.common.tokenizer import Tokenizer
from baton.train.base_recipe import check_base, recipe_from_dict
from baton.train.schedule import warmup_cosine
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


@dataclass
class MedusaTrainConfig:
    base: str  # handoff checkpoint directory of the (frozen) base model
    data: DataConfig = field(default_factory=DataConfig)
    num_heads: int = 3
    num_layers: int = 1
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 20  # then cosine decay to 0 at `steps` (baton.train.schedule)
    decay: float = 0.8  # weight of head k's loss: decay ** k
    seed: int = 1234

    def __post_init__(self) -> None:
        check_base("medusa", self.base, "the heads train on its tokens")
        if self.num_heads < 1 or self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError("medusa needs num_heads >= 1, steps >= 1, batch_size >= 1 and lr > 0")
        if self.data.seq_len <= self.num_heads + 1:
            raise ValueError(f"data.seq_len {self.data.seq_len} must exceed num_heads + 1")


def medusa_config_from_dict(raw: dict, overrides: list[str] | tuple[str, ...] = ()) -> MedusaTrainConfig:
    """A `baton train` recipe {medusa: {base: ..., num_heads: ...}, data: {...}}, checked up front."""
    return recipe_from_dict(raw, overrides, "medusa", MedusaTrainConfig, "a Medusa")


def medusa_loss(
    heads: MedusaHeads, hidden: torch.Tensor, tokens: torch.Tensor, decay: float
) -> tuple[torch.Tensor, list[float]]:
    """hidden [B, S, H] at positions 0..S-1 of tokens [B, S+1]; head k targets tokens[:, t+k+2]."""
    logits = heads(hidden)  # [K, B, S, V]
    total, per_head = hidden.new_zeros(()), []
    for k in range(logits.shape[0]):
        shift = k + 2
        pred = logits[k][:, : tokens.shape[1] - shift]
        loss = F.cross_entropy(pred.reshape(-1, pred.shape[-1]).float(), tokens[:, shift:].reshape(-1))
        total = total + decay**k * loss
        per_head.append(loss.item())
    return total, per_head


def train_medusa(cfg: MedusaTrainConfig) -> Path:
    torch.manual_seed(cfg.seed)
    base = load_checkpoint(cfg.base).model.eval()
    for p in base.parameters():
        p.requires_grad_(False)
    tok = Tokenizer.from_dir(cfg.base)
    train_ds, _ = build_datasets(cfg.data, tok)
    mc = base.config
    heads = MedusaHeads(MedusaConfig(mc.hidden_size, mc.vocab_size, cfg.num_heads, cfg.num_layers))
    heads.init_from_lm_head(base.lm_head)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    log.info(
        "training %d Medusa heads on frozen %s (%d blocks of %d tokens)",
        cfg.num_heads,
        cfg.base,
        len(train_ds),
        cfg.data.seq_len,
    )

    if len(train_ds) < cfg.batch_size:
        raise ValueError(
            f"{len(train_ds)} training blocks of {cfg.data.seq_len + 1} tokens make no full batch of "
            f"{cfg.batch_size}: use more data, a smaller data.seq_len or medusa.batch_size"
        )

    def batches():
        epoch = 0
        while True:
            yield from (
                b for b in torch_loader(train_ds, cfg.batch_size, seed=cfg.seed + epoch) if b.shape[0] == cfg.batch_size
            )
            epoch += 1

    stream = batches()
    bar = tqdm(range(cfg.steps), desc="medusa heads", unit="step", mininterval=2.0)
    start = time.perf_counter()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = warmup_cosine(step, cfg.lr, 0.0, cfg.warmup_steps, cfg.steps)
        batch = next(stream)
        with torch.no_grad():
            hidden = base.hidden(batch[:, :-1])
        loss, per_head = medusa_loss(heads, hidden, batch, cfg.decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", heads=" ".join(f"{x:.2f}" for x in per_head))
    log.info(
        "Medusa heads trained in %.0f s; per-head loss %s",
        time.perf_counter() - start,
        ", ".join(f"{x:.3f}" for x in per_head),
    )
    save_medusa(heads, cfg.base)
    return Path(cfg.base)
