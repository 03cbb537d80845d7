"""EAGLE: train a draft head (baton.common.eagle) on a frozen target, from a corpus (`data:`).

Each batch runs the frozen target once for its features (the last hidden state at unit RMS) and
its next-token distributions; the head, teacher-forced on those features, predicts the next
position's feature. EAGLE's loss: smooth-L1 between the predicted and the target's feature
(`feature_weight`) plus the cross-entropy of the target's distribution under the draft
distribution the target's norm and LM head give the prediction (`token_weight`; the paper uses
1.0 and 0.1). Uniform noise on the input features (`feature_noise`, EAGLE's augmentation) makes
the head tolerate its own errors when it drafts further on predicted features.

At serving the head only ever sees features from a prompt's last token on (the engine computes
hidden states only where it samples), so each training row keeps a random prefix out of the
head's attention, as a prompt would be: the head learns to draft from a short own context.

It learns best from the target's own continuations: run `baton distill` and point data.path at
the file it writes (any text works: the targets are the target's features and distributions, not
the corpus's tokens). The head is written into the target's handoff directory, where
`baton serve --speculative eagle` finds it. `baton train` runs this for a recipe with a top-level
`eagle:` section (configs/demo-eagle.yaml).
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
from baton.common.eagle import EagleConfig, EagleHead, features, save_eagle
from baton.common.model import CausalLM
from baton.common.tokenizer import Tokenizer
from baton.train.base_recipe import check_base, recipe_from_dict
from baton.train.schedule import warmup_cosine
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


@dataclass
class EagleTrainConfig:
    base: str  # handoff checkpoint directory of the (frozen) target model
    data: DataConfig = field(default_factory=DataConfig)
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 20  # then cosine decay to 0 at `steps` (baton.train.schedule)
    feature_weight: float = 1.0  # smooth-L1 feature regression
    token_weight: float = 0.1  # cross-entropy against the target's next-token distribution
    feature_noise: float = 0.1  # U(-a, a) added to the input features while training
    seed: int = 1234

    def __post_init__(self) -> None:
        check_base("eagle", self.base, "the head trains on its tokens")
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0 or self.warmup_steps < 0:
            raise ValueError("eagle needs steps >= 1, batch_size >= 1, lr > 0 and warmup_steps >= 0")
        if self.feature_weight < 0 or self.token_weight < 0 or self.feature_weight + self.token_weight == 0:
            raise ValueError("eagle's feature_weight and token_weight must be >= 0, not both 0")
        if self.feature_noise < 0:
            raise ValueError(f"eagle.feature_noise must be >= 0, got {self.feature_noise}")
        if self.data.seq_len < 3:
            raise ValueError(f"data.seq_len {self.data.seq_len} must be >= 3 (a feature, a next one and a token)")


def eagle_config_from_dict(raw: dict, overrides: list[str] | tuple[str, ...] = ()) -> EagleTrainConfig:
    """A `baton train` recipe {eagle: {base: ..., steps: ...}, data: {...}}, checked up front."""
    return recipe_from_dict(raw, overrides, "eagle", EagleTrainConfig, "an EAGLE")


@torch.no_grad()
def target_outputs(base: CausalLM, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [B, S, H], next-token probabilities [B, S, V]) of the frozen target on tokens [B, S]."""
    normed = base.hidden(tokens)
    return features(normed, base.model.final_norm), torch.softmax(base.compute_logits(normed).float(), -1)


def prompt_mask(starts: torch.Tensor, s: int) -> torch.Tensor:
    """[B, 1, S, S] attention mask: row j sees rows starts[b]..j (itself, when j < starts[b])."""
    i = torch.arange(s, device=starts.device)
    causal = i[None, :, None] >= i[None, None, :]
    own = torch.eye(s, dtype=torch.bool, device=starts.device)
    return ((causal & (i[None, None, :] >= starts[:, None, None])) | own)[:, None]


def prompt_starts(batch: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A cut-off prompt per row, as at serving: half the rows start within their block's first
    half, the others see the whole block."""
    b, s = batch.shape[0], batch.shape[1] - 1
    cut = torch.randint(0, max(1, s // 2), (b,), generator=generator)
    return torch.where(torch.rand(b, generator=generator) < 0.5, cut, torch.zeros_like(cut))


class _Masked:
    """Dense attention under a fixed boolean mask (the training rows' cut-off prompts)."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def __call__(self, q, k, v, layer):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=layer.scaling, enable_gqa=True)
        return out.transpose(1, 2)


def eagle_loss(
    head: EagleHead,
    feats: torch.Tensor,
    probs: torch.Tensor,
    tokens: torch.Tensor,
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
    feature_noise: float = 0.0,
    starts: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """feats/probs [B, S, ...] from target_outputs(tokens [B, S]). Row t reads feature t and token
    t + 1 and is scored against feature t + 1 and the target's distribution there (of token t + 2).
    Rows before starts[b] (a cut-off prompt) are context only and not scored."""
    b, s = tokens.shape
    x = feats[:, :-1]
    if feature_noise and head.training:
        x = x + (torch.rand(x.shape, generator=generator, device=x.device) * 2 - 1) * feature_noise
    positions = torch.arange(s - 1, device=tokens.device).expand(b, -1)
    attn = _Masked(prompt_mask(starts, s - 1)) if starts is not None else None
    pred = head(x, tokens[:, 1:], positions, attn)
    scored = torch.ones_like(positions, dtype=torch.bool) if starts is None else positions >= starts[:, None]
    reg = F.smooth_l1_loss(pred, feats[:, 1:], reduction="none").mean(-1)[scored].mean()
    logp = torch.log_softmax(head.logits(pred).float(), -1)
    ce = -(probs[:, 1:] * logp).sum(-1)[scored].mean()
    agree = (logp.argmax(-1) == probs[:, 1:].argmax(-1))[scored].float().mean()
    total = feature_weight * reg + token_weight * ce
    return total, {"feature": reg.item(), "token": ce.item(), "top1": agree.item()}


def train_eagle(cfg: EagleTrainConfig) -> Path:
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    base = load_checkpoint(cfg.base).model.eval()
    for p in base.parameters():
        p.requires_grad_(False)
    tok = Tokenizer.from_dir(cfg.base)
    train_ds, _ = build_datasets(cfg.data, tok)
    if len(train_ds) < cfg.batch_size:
        raise ValueError(
            f"{len(train_ds)} training blocks of {cfg.data.seq_len + 1} tokens make no full batch of "
            f"{cfg.batch_size}: use more data, a smaller data.seq_len or eagle.batch_size"
        )
    head = EagleHead(EagleConfig(base.config.to_dict())).to(next(base.parameters()).dtype)
    head.attach(base.model.embed_tokens, base.model.final_norm, base.lm_head)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    log.info("training an EAGLE head on frozen %s (%d blocks of %d tokens)", cfg.base, len(train_ds), cfg.data.seq_len)

    def batches():
        epoch = 0
        while True:
            yield from (
                b for b in torch_loader(train_ds, cfg.batch_size, seed=cfg.seed + epoch) if b.shape[0] == cfg.batch_size
            )
            epoch += 1

    stream = batches()
    bar = tqdm(range(cfg.steps), desc="eagle head", unit="step", mininterval=2.0)
    start, parts = time.perf_counter(), {}
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = warmup_cosine(step, cfg.lr, 0.0, cfg.warmup_steps, cfg.steps)
        batch = next(stream)
        feats, probs = target_outputs(base, batch)
        starts = prompt_starts(batch, gen)
        loss, parts = eagle_loss(
            head, feats, probs, batch, cfg.feature_weight, cfg.token_weight, cfg.feature_noise, starts, gen
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{parts['top1']:.2f}")
    log.info(
        "EAGLE head trained in %.0f s; feature %.4f, token %.3f, top-1 agreement with the target %.2f",
        time.perf_counter() - start,
        parts["feature"],
        parts["token"],
        parts["top1"],
    )
    save_eagle(head.eval(), cfg.base)
    return Path(cfg.base)
