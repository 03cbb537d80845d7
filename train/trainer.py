"""The training loop (nanoGPT-shaped): data -> model -> AdamW with warmup+cosine -> handoff.

One readable loop. What varies lives elsewhere: the recipe (config.py), how a step runs across
processes (backends/), the schedule (schedule.py), recomputation (recompute.py), checkpoints
(checkpointing.py), logs and MFU (metrics.py) and the handoff (export.py). Every check that can
fail runs before the first step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from baton.common.errors import begin_work
from baton.common.model import build_model
from baton.common.tokenizer import Tokenizer, train_bpe, train_char
from baton.train import checkpointing, provenance
from baton.train.backends import Backend, build_backend
from baton.train.config import TrainConfig
from baton.common.data import build_datasets, read_texts, torch_loader
from baton.train.distributed import Dist, init_distributed, read_launch
from baton.train.export import export_checkpoint
from baton.train.metrics import MetricsLogger, flops_per_token, measure_matmul_peak, plot_losses
from baton.train.recompute import apply_recompute
from baton.train.batches import DataPosition, GlobalBatches, micro_batches
from baton.train.schedule import lr_at

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many non-finite losses in a row; the last checkpoint on disk is from before them."""


@dataclass
class TrainResult:
    handoff_dir: Path | None
    checkpoint_dir: Path | None
    steps: int
    tokens_seen: int
    final_train_loss: float
    final_val_loss: float | None
    tokens_per_second: float  # training steps only (evaluation and checkpointing excluded)
    skipped_steps: int


def prepare_tokenizer(cfg: TrainConfig, dist: Dist, resume: Path | None) -> Tokenizer:
    """The checkpoint's tokenizer on resume, else the configured one, else one trained on the
    training text by rank 0 (cached in out_dir) while the other ranks wait."""
    if resume is not None:
        return Tokenizer.from_dir(resume / "tokenizer")
    if cfg.tokenizer.path:
        return Tokenizer.from_dir(cfg.tokenizer.path)
    cached = Path(cfg.out_dir) / "tokenizer"
    if dist.is_main and not (cached / "tokenizer.json").is_file():
        texts = read_texts(cfg.data)
        log.info("training a %s tokenizer on the training text", cfg.tokenizer.kind)
        tok = train_char("".join(texts)) if cfg.tokenizer.kind == "char" else train_bpe(texts, cfg.tokenizer.vocab_size)
        tok.save(cached)
    dist.barrier()
    return Tokenizer.from_dir(cached)


@torch.no_grad()
def evaluate(backend: Backend, val_ds, cfg: TrainConfig) -> float | None:
    """Mean loss over the first eval_batches validation batches; every rank runs the same ones
    (ZeRO-3 needs all ranks in every forward), so all get the same number."""
    if val_ds is None or len(val_ds) == 0:
        return None
    losses = []
    for i, batch in enumerate(torch_loader(val_ds, cfg.micro_batch_size, seed=0, shuffle=False)):
        if i >= cfg.eval_batches:
            break
        losses.append(backend.eval_loss(batch))
    return sum(losses) / len(losses)


def _check(cfg: TrainConfig, rank: int, world_size: int) -> tuple[Path | None, dict | None, dict]:
    """Every check of the recipe against the world size, the machine and the checkpoint it resumes:
    (checkpoint, its state, this run's inputs)."""
    cfg.validate(cfg.data_parallel_size(world_size))
    if cfg.backend == "deepspeed":
        from baton.train.backends.deepspeed import check_environment

        check_environment(cfg)
    resume = checkpointing.resolve_resume(cfg)
    saved = checkpointing.read_state(resume) if resume else None
    inputs = provenance.describe(cfg)
    if saved:
        checkpointing.check_resumable(saved, resume, cfg, cfg.data_parallel_size(world_size))
        provenance.check_resume_inputs(saved, resume, cfg, inputs, main=rank == 0)
    return resume, saved, inputs


def train(cfg: TrainConfig) -> TrainResult:
    """Train per the recipe; under a launcher (or srun), every rank calls this."""
    # ---- checks: no process group is made, and nothing built or written, before these pass
    launch = read_launch()
    resume, saved, inputs = _check(cfg, launch.rank, launch.world_size)
    dist = init_distributed(need_group=cfg.backend in ("deepspeed", "torch3d"))
    if (dist.rank, dist.world_size) != (launch.rank, launch.world_size):  # a caller made the group itself
        resume, saved, inputs = _check(cfg, dist.rank, dist.world_size)
    dp, dp_rank = cfg.data_parallel_size(dist.world_size), cfg.data_parallel_rank(dist.rank, dist.world_size)

    # ---- data, model, backend
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = prepare_tokenizer(cfg, dist, resume)
    inputs = provenance.with_tokenizer(inputs, tok)
    model_cfg = cfg.model_config(tok.vocab_size, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                 pad_token_id=tok.pad_token_id)
    if saved:
        checkpointing.check_model(saved, resume, model_cfg)
    if not dist.is_main:
        dist.barrier()  # rank 0 tokenizes and caches first; the others then read its cache
    train_ds, val_ds = build_datasets(cfg.data, tok)
    if dist.is_main:
        dist.barrier()
    accum, global_batch, seq = cfg.accum_steps(dp), cfg.global_batch(dp), cfg.data.seq_len
    step, tokens_seen, nan_streak, skipped, position = 0, 0, 0, 0, DataPosition()
    sampler = GlobalBatches(train_ds, global_batch, cfg.seed, position)  # raises if the data is too small
    begin_work()  # the checks are over: from here on, a ValueError is a bug, shown with its traceback
    model = build_model(model_cfg, seed=cfg.seed)
    attn = apply_recompute(model, cfg.recompute)
    backend = build_backend(cfg, model, attn, dist)
    if dist.is_main:
        log.info("model %s, %.2fM parameters; %d train / %d val blocks of %d tokens; %s backend, world size %d, "
                 "global batch %d = %d micro x %d accum x %d ranks", model_cfg.model_type,
                 model_cfg.num_parameters() / 1e6, len(train_ds), len(val_ds), seq, cfg.backend,
                 dist.world_size, global_batch, cfg.micro_batch_size, accum, dp)
    if saved:
        backend.load(resume, checkpointing.saved_layout(saved))
        step, tokens_seen, nan_streak = saved["step"], saved["tokens_seen"], saved["nan_streak"]
        skipped = saved["skipped_steps"]
        sampler.position = DataPosition(**saved["data"])
        checkpointing.restore_rng(resume, dist, saved["layout"]["world_size"] == dist.world_size, cfg.seed, step)
        if dist.is_main:
            log.info("resumed from %s at step %d", resume, step)

    metrics = MetricsLogger(out_dir, dist.is_main, step, cfg.logging.tensorboard)
    device = f"cuda:{dist.local_rank}" if torch.cuda.is_available() else "cpu"
    peak = None
    if cfg.logging.mfu:  # every rank at once: ranks sharing cores measure the share they get
        peak = dist.all_reduce_sum(torch.tensor([measure_matmul_peak(device)], device=device)).item()
    flops_tok = flops_per_token(model_cfg, seq)
    root = checkpointing.checkpoints_root(out_dir)
    last_ckpt = resume
    bar = tqdm(total=cfg.max_steps, initial=step, desc="training", unit="step", dynamic_ncols=True,
               mininterval=2.0, disable=not (dist.is_main and cfg.logging.progress))
    loss_value, val_loss, train_time, steps_timed = float("nan"), None, 0.0, 0

    # ---- the loop
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        batch = sampler.next()
        parts = micro_batches(batch, cfg.micro_batch_size, accum, dp_rank, dp)
        losses = [backend.forward_backward(mb, last=i == accum - 1) for i, mb in enumerate(parts)]
        loss_sum = dist.all_reduce_sum(torch.stack(losses).sum().reshape(1).to(device))
        loss_value = loss_sum.item() / (accum * dist.world_size)
        result = backend.step(lr, math.isfinite(loss_value))
        step += 1
        tokens_seen += global_batch * seq
        dt = time.perf_counter() - t0
        train_time, steps_timed = train_time + dt, steps_timed + 1
        tps = steps_timed * global_batch * seq / train_time
        if result.applied:
            nan_streak = 0
        else:
            nan_streak, skipped = nan_streak + 1, skipped + 1
            if dist.is_main:
                log.warning("step %d: non-finite loss (%s) or gradients (norm %s): update skipped (%d in a row)",
                            step, loss_value, result.grad_norm, nan_streak)
            if nan_streak >= cfg.max_nan_steps:
                raise TrainingDiverged(f"{nan_streak} non-finite steps in a row at step {step}; stopping. The last "
                                       f"good checkpoint is {last_ckpt or 'none (none was saved yet)'}")
        record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": result.grad_norm, "tokens_per_s": tps,
                  "mfu": tps * flops_tok / peak if peak else None, "skipped": not result.applied,
                  "elapsed_s": train_time}
        last = step == cfg.max_steps
        if (cfg.eval_interval and step % cfg.eval_interval == 0) or last:
            val_loss = record["val_loss"] = evaluate(backend, val_ds, cfg)
            if dist.is_main:
                log.info("step %d: train loss %.4f, val loss %s", step, loss_value,
                         "n/a" if val_loss is None else f"{val_loss:.4f}")
        if step % cfg.log_interval == 0 or "val_loss" in record or last or not result.applied:
            metrics.log(record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", refresh=False)
        if result.applied and ((cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0) or last):
            last_ckpt = root / f"step_{step:08d}"
            trainer_state = {"step": step, "tokens_seen": tokens_seen, "data": sampler.state_dict(),
                             "global_batch": global_batch, "nan_streak": nan_streak, "skipped_steps": skipped,
                             "seed": cfg.seed, "inputs": inputs}
            checkpointing.save(last_ckpt, backend, dist, trainer_state, model_cfg, tok)
            if dist.is_main:
                checkpointing.prune(root, cfg.checkpoint.keep_last)
    bar.close()
    metrics.close()

    # ---- handoff
    handoff = None
    if dist.is_main:
        if cfg.logging.plot and metrics.records:
            plot_losses(metrics.records, out_dir / "loss.png", title=f"{out_dir.name}: {cfg.backend}")
        if cfg.export and last_ckpt is not None:
            handoff = export_checkpoint(last_ckpt, out_dir / "handoff")
            log.info("handed off the trained model to %s", handoff)
    dist.barrier()
    return TrainResult(handoff, last_ckpt, step, tokens_seen, loss_value, val_loss,
                       steps_timed * global_batch * seq / train_time if train_time else 0.0, skipped)
