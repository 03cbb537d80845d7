"""The training loop (torchtitan-shaped): data -> model -> AdamW with warmup+cosine -> handoff.

`Trainer.train_step` is one optimizer step: this rank's micro-batches of the next global batch go
to the backend, which runs forward, backward and the update at once; the trainer counts and logs.
What varies lives elsewhere: the recipe (config.py; its checks validate.py), how a step runs across
processes (backends/), the data order (batches.py), the schedule (schedule.py), recomputation
(recompute.py), checkpoints and resume (checkpointing.py), the handoff (export.py), logs and MFU
(metrics.py). Every check that can fail runs before the first step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from baton.common.checkpoint import CheckpointError, verify_hashes
from baton.common.config import ConfigError
from baton.common.data import build_datasets, read_texts, torch_loader
from baton.common.errors import begin_work
from baton.common.model import build_model
from baton.common.tokenizer import Tokenizer, train_bpe, train_char
from baton.train.backends import COMPUTE_DTYPES, Backend, StepResult, build_backend
from baton.train.balancing import attach_balancing
from baton.train.batches import GlobalBatches, micro_batches
from baton.train.checkpointing import Checkpointer
from baton.train.config import TrainConfig
from baton.train.distributed import Dist, init_distributed, read_launch
from baton.train.export import handoff as export_handoff
from baton.train.metrics import MetricsLogger, flops_per_token, peak_flops, plot_losses
from baton.train.moe import router_metrics
from baton.train.mtp import MTPLoss
from baton.train.pretrained import PretrainedWeights, pretrained_model
from baton.train.recompute import apply_recompute
from baton.train.schedule import lr_at
from baton.train.validate import validate
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


MIN_LOSS_SCALE = 1.0  # fp16: overflows below this scale count as non-finite steps (the run is diverging)


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
    """The checkpoint's tokenizer on resume, else the configured one, else init_from's (a model
    is fine-tuned with the tokenizer it was trained with), else one trained on the training text by
    rank 0 (cached in out_dir) while the other ranks wait."""
    if resume is not None:
        return Tokenizer.from_dir(resume / "tokenizer")
    if cfg.tokenizer.path:
        return Tokenizer.from_dir(cfg.tokenizer.path)
    if cfg.init_from:
        return Tokenizer.from_dir(cfg.init_from)
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


def _check(cfg: TrainConfig, rank: int, world_size: int) -> Checkpointer:
    """Every check of the recipe against the world size, the machine and the checkpoint it resumes;
    the checkpointer that holds that checkpoint."""
    validate(cfg, cfg.data_parallel_size(world_size))
    if cfg.init_from and rank == 0:
        try:
            verify_hashes(cfg.init_from)  # a handoff's sha256s (baton.json); an HF directory has none
        except CheckpointError as e:
            raise ConfigError(f"init_from: {e}") from e
    if cfg.backend == "deepspeed":
        from baton.train.backends.deepspeed import check_environment

        check_environment(cfg)
    return Checkpointer(cfg, rank, world_size)


class Trainer:
    """One run of the recipe on this rank: made (checks first, then data, model, backend and the
    resume), then `fit` runs the steps and hands the model off."""

    def __init__(self, cfg: TrainConfig):
        # ---- checks: no process group is made, and nothing built or written, before these pass
        launch = read_launch()
        ckpt = _check(cfg, launch.rank, launch.world_size)
        dist = init_distributed(need_group=cfg.backend in ("deepspeed", "torch3d"))
        if (dist.rank, dist.world_size) != (launch.rank, launch.world_size):  # a caller made the group itself
            ckpt = _check(cfg, dist.rank, dist.world_size)
        self.cfg, self.dist, self.checkpointer = cfg, dist, ckpt
        self.dp = cfg.data_parallel_size(dist.world_size)
        self.dp_rank = cfg.data_parallel_rank(dist.rank, dist.world_size)

        # ---- data, model, backend
        torch.manual_seed(cfg.seed)
        self.out_dir = Path(cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tok = prepare_tokenizer(cfg, dist, ckpt.resume)
        model_cfg = cfg.model_config(
            tok.vocab_size, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id
        )
        ckpt.bind(dist, tok, model_cfg)
        weights = None  # init_from's weights, for a fresh run (a resumed one continues from its checkpoint)
        if cfg.init_from and ckpt.resume is None:
            try:  # every tensor the model needs is there, of the config's shape
                weights = PretrainedWeights(cfg.init_from, model_cfg)
            except CheckpointError as e:
                raise ConfigError(f"init_from: {e}") from e
        if not dist.is_main:
            dist.barrier()  # rank 0 tokenizes and caches first; the others then read its cache
        train_ds, self.val_ds = build_datasets(cfg.data, tok)
        if dist.is_main:
            dist.barrier()
        self.accum, self.global_batch, seq = cfg.accum_steps(self.dp), cfg.global_batch(self.dp), cfg.data.seq_len
        self.tokens_per_step = self.global_batch * seq
        self.batches = GlobalBatches(train_ds, self.global_batch, cfg.seed)  # raises if the data is too small
        begin_work()  # the checks are over: from here on, a ValueError is a bug, shown with its traceback
        if weights is not None:
            model = pretrained_model(cfg, model_cfg, dist, weights)
            if dist.is_main:
                log.info("fine-tuning %s: weights and tokenizer from it, fresh optimizer and data", cfg.init_from)
        else:
            model = build_model(model_cfg, seed=cfg.seed)
        attn = apply_recompute(model, cfg.recompute, cfg.attention)
        self.backend = build_backend(cfg, model, attn, dist, pretrained=weights)
        module = self.backend.module
        # DeepSeek-V3: the correction biases move after every step; its MTP modules train beside the model.
        self.balancer = attach_balancing(module, cfg.moe.bias_update_rate, cfg.moe.seq_aux_loss_coef)
        self.mtp = MTPLoss(module, cfg.mtp.weight, self.accum) if module.mtp is not None else None
        if dist.is_main:
            log.info(
                "model %s, %.2fM parameters; %d train / %d val blocks of %d tokens; %s backend, %s precision "
                "(float32 master weights), world size %d, global batch %d = %d micro x %d accum x %d ranks",
                model_cfg.model_type,
                model_cfg.num_parameters() / 1e6,
                len(train_ds),
                len(self.val_ds),
                seq,
                cfg.backend,
                cfg.precision,
                dist.world_size,
                self.global_batch,
                cfg.micro_batch_size,
                self.accum,
                self.dp,
            )
        self.state = ckpt.maybe_resume(self.backend, self.batches)

        # ---- logs
        self.metrics = MetricsLogger(self.out_dir, dist.is_main, self.state.step, cfg.logging.tensorboard)
        self.peak = None
        if cfg.logging.mfu:  # every rank at once: ranks sharing cores measure the share they get
            peak, source = peak_flops(dist.device, COMPUTE_DTYPES[cfg.precision])
            self.peak = dist.all_reduce_sum(torch.tensor([peak], dtype=torch.float64, device=dist.device)).item()
            if dist.is_main:
                log.info(
                    "MFU against %.1f TFLOP/s (%s, %s, summed over %d ranks)",
                    self.peak / 1e12,
                    source,
                    cfg.precision,
                    dist.world_size,
                )
        self.flops_per_token = flops_per_token(model_cfg, seq)
        self.bar = tqdm(
            total=cfg.max_steps,
            initial=self.state.step,
            desc="training",
            unit="step",
            dynamic_ncols=True,
            mininterval=2.0,
            disable=not (dist.is_main and cfg.logging.progress),
        )
        self.loss, self.val_loss, self.train_time, self.steps_timed = float("nan"), None, 0.0, 0

    def fit(self) -> TrainResult:
        """Every step up to max_steps, checkpointed as the recipe says, then the handoff."""
        while self.state.step < self.cfg.max_steps:
            result = self.train_step()
            self.checkpointer.maybe_save(self.state, result.applied, self.backend, self.batches)
        self.bar.close()
        self.metrics.close()
        if self.dist.is_main and self.cfg.logging.plot and self.metrics.records:
            title = f"{self.out_dir.name}: {self.cfg.backend}"
            plot_losses(self.metrics.records, self.out_dir / "loss.png", title=title)
        handoff = export_handoff(self.checkpointer)
        self.dist.barrier()
        return TrainResult(
            handoff,
            self.checkpointer.last,
            self.state.step,
            self.state.tokens_seen,
            self.loss,
            self.val_loss,
            self._tokens_per_second(),
            self.state.skipped_steps,
        )

    def train_step(self) -> StepResult:
        """One optimizer step: this rank's micro-batches -> the backend's step -> counts and logs."""
        t0 = time.perf_counter()
        lr = lr_at(self.state.step, self.cfg)
        parts = micro_batches(self.batches.next(), self.cfg.micro_batch_size, self.accum, self.dp_rank, self.dp)
        if (early_exit := getattr(self.backend, "early_exit", None)) is not None:
            early_exit.step = self.state.step  # LayerSkip's curriculum and dropout warm-up
        if self.mtp is not None:
            self.mtp.feed(parts)
        result = self.backend.train_step(parts, lr)
        if self.balancer is not None:
            self.balancer.step(result.applied)
        self.train_time, self.steps_timed = self.train_time + time.perf_counter() - t0, self.steps_timed + 1
        self.state.step += 1
        self.state.tokens_seen += self.tokens_per_step
        self.loss = result.loss
        self._count_skipped(result)
        self._log(result, lr)
        return result

    def _count_skipped(self, result: StepResult) -> None:
        """A skipped step is counted; too many non-finite ones in a row stop the run (an fp16 overflow
        the loss scaler recovers from is not one of them)."""
        state = self.state
        if result.applied:
            state.nan_streak = 0
            return
        if result.overflow and result.loss_scale >= MIN_LOSS_SCALE:
            # fp16's loss scaler at work, not a diverging run: this batch's update is dropped, the scale halved
            # (the non-finite streak stays where it was; below MIN_LOSS_SCALE it counts, as DeepSpeed stops at 1).
            state.skipped_steps += 1
            if self.dist.is_main:
                log.info(
                    "step %d: fp16 gradients overflowed at loss scale %g: update skipped, scale halved",
                    state.step,
                    result.loss_scale,
                )
            return
        state.nan_streak, state.skipped_steps = state.nan_streak + 1, state.skipped_steps + 1
        if self.dist.is_main:
            log.warning(
                "step %d: non-finite loss (%s) or gradients (norm %s): update skipped (%d in a row)",
                state.step,
                result.loss,
                result.grad_norm,
                state.nan_streak,
            )
        if state.nan_streak >= self.cfg.max_nan_steps:
            last = self.checkpointer.last
            raise TrainingDiverged(
                f"{state.nan_streak} non-finite steps in a row at step {state.step}; stopping. The "
                f"last good checkpoint is {last or 'none (none was saved yet)'}"
            )

    def _log(self, result: StepResult, lr: float) -> None:
        """The step's record (with the validation loss when due) to the metrics and the progress bar."""
        cfg, step = self.cfg, self.state.step
        tps = self._tokens_per_second()
        record = {
            "step": step,
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens_per_s": tps,
            "mfu": tps * self.flops_per_token / self.peak if self.peak else None,
            "skipped": not result.applied,
            "elapsed_s": self.train_time,
        }
        if result.loss_scale is not None:
            record["loss_scale"] = result.loss_scale
        last = step == cfg.max_steps
        if (cfg.eval_interval and step % cfg.eval_interval == 0) or last:
            self.val_loss = record["val_loss"] = evaluate(self.backend, self.val_ds, cfg)
            if self.dist.is_main:
                log.info(
                    "step %d: train loss %.4f, val loss %s",
                    step,
                    result.loss,
                    "n/a" if self.val_loss is None else f"{self.val_loss:.4f}",
                )
        if step % cfg.log_interval == 0 or "val_loss" in record or last or not result.applied:
            record.update(router_metrics(self.backend.module))  # MoE: router losses since the last record
            if self.balancer is not None:  # DeepSeek-V3: expert load imbalance since the last record
                record.update(self.balancer.metrics())
            if self.mtp is not None:
                record.update(self.mtp.metrics())
            if (early_exit := getattr(self.backend, "early_exit", None)) is not None:
                record.update(early_exit.metrics())  # LayerSkip: each exit's loss
            self.metrics.log(record)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{result.loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", refresh=False)

    def _tokens_per_second(self) -> float:
        """Over the training steps of this process (evaluation and checkpointing excluded)."""
        return self.steps_timed * self.tokens_per_step / self.train_time if self.train_time else 0.0


def train(cfg: TrainConfig) -> TrainResult:
    """Train per the recipe; under a launcher (or srun), every rank calls this."""
    return Trainer(cfg).fit()
