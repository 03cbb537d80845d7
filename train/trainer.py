"""The training loop (nanoGPT-shaped): data -> model -> AdamW with warmup+cosine -> handoff.

One readable loop; what varies between runs (the recipe) lives in TrainConfig. The result is a
handoff checkpoint (baton.common.checkpoint) that the server and transformers both load.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from baton.common.checkpoint import HandoffMetadata, save_model
from baton.common.model import CausalLM, build_model
from baton.common.tokenizer import Tokenizer, train_bpe, train_char
from baton.train.config import TrainConfig
from baton.train.data import build_datasets, torch_loader

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    handoff_dir: Path
    steps: int
    tokens_seen: int
    final_train_loss: float
    final_val_loss: float | None
    tokens_per_second: float


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at max_steps."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, cfg.max_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: CausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (not norms, biases) as in nanoGPT/Megatron."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    o = cfg.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def prepare_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """Load the configured tokenizer, or train one on the training text (cached in out_dir)."""
    if cfg.tokenizer.path:
        return Tokenizer.from_dir(cfg.tokenizer.path)
    cached = Path(cfg.out_dir) / "tokenizer"
    if (cached / "tokenizer.json").is_file():
        return Tokenizer.from_dir(cached)
    from baton.train.data import read_texts

    texts = read_texts(cfg.data)
    log.info("training a %s tokenizer on the training text", cfg.tokenizer.kind)
    if cfg.tokenizer.kind == "char":
        tok = train_char("".join(texts))
    else:
        tok = train_bpe(texts, vocab_size=cfg.tokenizer.vocab_size)
    tok.save(cached)
    return tok


def loss_fn(model: CausalLM, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: CausalLM, val_ds, cfg: TrainConfig) -> float | None:
    if val_ds is None or len(val_ds) == 0:
        return None
    model.eval()
    losses = []
    for i, batch in enumerate(torch_loader(val_ds, cfg.micro_batch_size, seed=0, shuffle=False)):
        if i >= cfg.eval_batches:
            break
        losses.append(loss_fn(model, batch).item())
    model.train()
    return sum(losses) / len(losses)


def batches(train_ds, cfg: TrainConfig):
    """Endless micro-batches; each epoch reshuffled with seed + epoch."""
    epoch = 0
    while True:
        for batch in torch_loader(train_ds, cfg.micro_batch_size, seed=cfg.seed + epoch):
            if batch.shape[0] == cfg.micro_batch_size:  # fixed shapes keep steps comparable
                yield batch
        epoch += 1


def train(cfg: TrainConfig) -> TrainResult:
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = prepare_tokenizer(cfg)
    train_ds, val_ds = build_datasets(cfg.data, tok)
    if len(train_ds) < cfg.micro_batch_size:
        raise ValueError(f"the training split has {len(train_ds)} blocks, fewer than micro_batch_size "
                         f"{cfg.micro_batch_size}: use more data or a shorter data.seq_len")
    model_cfg = cfg.model_config(tok.vocab_size, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                 pad_token_id=tok.pad_token_id)
    model = build_model(model_cfg, seed=cfg.seed)
    log.info("model: %s, %.2fM parameters; %d train / %d val blocks of %d tokens", model_cfg.model_type,
             model_cfg.num_parameters() / 1e6, len(train_ds), len(val_ds), cfg.data.seq_len)
    opt = make_optimizer(model, cfg)
    stream = batches(train_ds, cfg)
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum_steps * cfg.data.seq_len
    history: list[dict] = []
    val_loss, loss_value = None, float("nan")
    start = time.perf_counter()
    bar = tqdm(range(cfg.max_steps), desc="training", unit="step", dynamic_ncols=True, mininterval=2.0)
    for step in bar:
        lr = lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        total = 0.0
        for _ in range(cfg.grad_accum_steps):
            loss = loss_fn(model, next(stream)) / cfg.grad_accum_steps
            loss.backward()
            total += loss.item()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = total
        elapsed = time.perf_counter() - start
        tps = (step + 1) * tokens_per_step / elapsed
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
        record = {"step": step + 1, "loss": loss_value, "lr": lr, "tokens_per_s": tps}
        last = step + 1 == cfg.max_steps
        if (cfg.eval_interval and (step + 1) % cfg.eval_interval == 0) or last:
            val_loss = evaluate(model, val_ds, cfg)
            record["val_loss"] = val_loss
            log.info("step %d: train loss %.4f, val loss %s", step + 1, loss_value,
                     f"{val_loss:.4f}" if val_loss is not None else "n/a")
        history.append(record)
    bar.close()
    (out_dir / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    tokens_seen = cfg.max_steps * tokens_per_step
    handoff = save_model(out_dir / "handoff", model, tokenizer=tok,
                         metadata=HandoffMetadata(producer="baton train", step=cfg.max_steps, tokens_seen=tokens_seen,
                                                  parallel_layout={"dp": 1, "tp": 1, "pp": 1, "cp": 1}))
    log.info("handed off the trained model to %s", handoff)
    return TrainResult(handoff, cfg.max_steps, tokens_seen, loss_value, val_loss,
                       tokens_seen / (time.perf_counter() - start))
