"""Resumable training checkpoints: out_dir/checkpoints/step_XXXXXXXX/, and the `Checkpointer`
that does all the trainer does with them (resume checks, resume, periodic saves; the handoff of
the last one is baton.train.export's).

Each holds the backend's model + optimizer state (see baton.train.backends), trainer_state.json
(step, data position, layout, tokens seen, skipped-step streak), every rank's RNG state, the
model's config.json and the tokenizer, so `baton export` needs nothing else.

Saving is atomic across ranks: rank 0 opens a hidden temporary directory (atomic_directory),
every rank writes its part into it, and only after a barrier does rank 0 swap it into place; a
run killed during a save leaves the previous checkpoints untouched. The last `keep_last` are kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from baton.common.checkpoint import atomic_directory
from baton.common.config import ConfigError, ModelConfig
from baton.common.hf import config_to_hf
from baton.common.tokenizer import Tokenizer
from baton.train import provenance
from baton.train.backends import Backend, Layout
from baton.train.batches import GlobalBatches
from baton.train.config import TrainConfig
from baton.train.distributed import Dist
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
FORMAT = "baton-train-checkpoint"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoints_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete step checkpoints under `root`, oldest first (temporary ones are hidden dirs)."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def find_checkpoint(path: str | Path) -> Path:
    """A step checkpoint, given one, a checkpoints/ folder or a run's out_dir (latest wins)."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    found = list_checkpoints(path) or list_checkpoints(checkpoints_root(path))
    if not found:
        raise ConfigError(f"{path} holds no training checkpoint ({STATE_FILE} not found)")
    return found[-1]


def resolve_resume(cfg: TrainConfig) -> Path | None:
    r = cfg.checkpoint.resume
    if r == "never":
        return None
    if r == "auto":
        found = list_checkpoints(checkpoints_root(cfg.out_dir))
        return found[-1] if found else None
    return find_checkpoint(r)


def read_state(path: Path) -> dict[str, Any]:
    state = json.loads((path / STATE_FILE).read_text())
    if state.get("format") != FORMAT:
        raise ConfigError(f"{path}/{STATE_FILE} is not a Baton training checkpoint")
    return state


def check_resumable(state: dict[str, Any], path: Path, cfg: TrainConfig, world_size: int) -> None:
    """What must not change across a resume: the samples per step (the data order depends on it), and
    for torch3d the checkpoint format. (The data, tokenizer and seeds: baton.train.provenance.)"""
    if state["global_batch"] != cfg.global_batch(world_size):
        raise ConfigError(
            f"cannot resume {path}: it was trained with a global batch of {state['global_batch']} "
            f"samples, this run has {cfg.global_batch(world_size)}; set global_batch_size="
            f"{state['global_batch']} (grad_accum_steps then follows the world size)"
        )
    if cfg.backend == "torch3d" and state["layout"]["backend"] != "torch3d":
        raise ConfigError(
            f"cannot resume {path}: it was written by backend {state['layout']['backend']!r}; backend "
            "torch3d resumes only its own (DCP) checkpoints, at any layout. Resume it with its own "
            "backend, or start a new run from its weights: `baton export` it and set init_from to the export"
        )
    if state["step"] > cfg.max_steps:
        raise ConfigError(f"cannot resume {path} (step {state['step']}) with max_steps={cfg.max_steps}")


def check_model(state: dict[str, Any], path: Path, model_cfg: ModelConfig) -> None:
    if state["model_config"] != model_cfg.to_dict():
        diff = sorted(k for k, v in model_cfg.to_dict().items() if state["model_config"].get(k) != v)
        raise ConfigError(f"cannot resume {path}: the model differs from the checkpoint's in {', '.join(diff)}")


def saved_layout(state: dict[str, Any]) -> Layout:
    return Layout(**state["layout"])


def save(
    directory: Path, backend: Backend, dist: Dist, state: dict[str, Any], model_cfg: ModelConfig, tokenizer: Tokenizer
) -> None:
    """Collective: write a checkpoint of the current step to `directory`, atomically."""
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(atomic_directory(directory)) if dist.is_main else None
        tmp = Path(dist.broadcast_object(str(tmp)))
        backend.save(tmp)
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        save_file(rng, tmp / f"rng_rank{dist.rank}.safetensors")
        if dist.is_main:
            full = {
                "format": FORMAT,
                "version": 1,
                "layout": asdict(backend.layout),
                "model_config": model_cfg.to_dict(),
                "created_unix": time.time(),
                **state,
            }
            (tmp / "config.json").write_text(json.dumps(config_to_hf(model_cfg), indent=2) + "\n")
            tokenizer.save(tmp / "tokenizer")
            (tmp / STATE_FILE).write_text(json.dumps(full, indent=2) + "\n")  # written last: marks it complete
        dist.barrier()  # every rank's part is on disk before rank 0 swaps the directory into place
    dist.barrier()  # ... and no rank goes on before it is in place
    if dist.is_main:
        log.info("saved checkpoint %s in %.1fs", directory, time.perf_counter() - t0)


def prune(root: Path, keep_last: int) -> None:
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def restore_rng(path: Path, dist: Dist, same_world_size: bool, seed: int, step: int) -> None:
    """Each rank's own RNG stream; at another world size there is no such thing, so reseed."""
    f = path / f"rng_rank{dist.rank}.safetensors"
    if same_world_size and f.is_file():
        rng = load_file(f)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        torch.manual_seed(seed + 1_000_003 * step + dist.rank)


@dataclass
class TrainState:
    """The loop's counters: what a checkpoint restores besides the model, optimizer, data and RNG."""

    step: int = 0
    tokens_seen: int = 0
    nan_streak: int = 0  # non-finite steps in a row, up to the last one
    skipped_steps: int = 0


class Checkpointer:
    """The trainer's checkpoints behind two calls, maybe_resume and maybe_save (the handoff of the
    last one: baton.train.export.handoff).

    Made during the checks, before any process group: the checkpoint to resume (checkpoint.resume)
    is found and checked against this run, its batch and inputs (data, tokenizer, seeds:
    baton.train.provenance). `bind` adds what is known later and saved with every checkpoint.
    """

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int):
        dp = cfg.data_parallel_size(world_size)
        self.cfg, self.global_batch = cfg, cfg.global_batch(dp)
        self.resume = resolve_resume(cfg)
        self.saved = read_state(self.resume) if self.resume else None
        self.inputs = provenance.describe(cfg)
        if self.saved:
            check_resumable(self.saved, self.resume, cfg, dp)
            provenance.check_resume_inputs(self.saved, self.resume, cfg, self.inputs, main=rank == 0)
        self.root = checkpoints_root(cfg.out_dir)
        self.last: Path | None = self.resume  # the newest complete checkpoint of this run
        self.dist: Dist | None = None
        self.tokenizer: Tokenizer | None = None
        self.model_cfg: ModelConfig | None = None

    def bind(self, dist: Dist, tokenizer: Tokenizer, model_cfg: ModelConfig) -> None:
        """The process group, tokenizer and model, once known; the model is checked against the
        checkpoint's (still before any work starts)."""
        self.inputs = provenance.with_tokenizer(self.inputs, tokenizer)
        if self.saved:
            check_model(self.saved, self.resume, model_cfg)
        self.dist, self.tokenizer, self.model_cfg = dist, tokenizer, model_cfg

    def maybe_resume(self, backend: Backend, batches: GlobalBatches) -> TrainState:
        """Collective: the checkpoint's model and optimizer into `backend`, its data position into
        `batches` and its RNG state; the counters to go on from (zero for a fresh run)."""
        if not self.saved:
            return TrainState()
        saved, dist = self.saved, self.dist
        backend.load(self.resume, saved_layout(saved))
        state = TrainState(saved["step"], saved["tokens_seen"], saved["nan_streak"], saved["skipped_steps"])
        batches.load_state_dict(saved["data"])
        restore_rng(self.resume, dist, saved["layout"]["world_size"] == dist.world_size, self.cfg.seed, state.step)
        if dist.is_main:
            log.info("resumed from %s at step %d", self.resume, state.step)
        return state

    def maybe_save(self, state: TrainState, applied: bool, backend: Backend, batches: GlobalBatches) -> None:
        """Collective: after an applied step due for one (every checkpoint.interval steps, and the
        last), save a checkpoint atomically and keep the newest checkpoint.keep_last. A skipped
        step is never saved: the checkpoint stays the last good state."""
        c = self.cfg.checkpoint
        due = (c.interval and state.step % c.interval == 0) or state.step == self.cfg.max_steps
        if not (applied and due):
            return
        self.last = self.root / f"step_{state.step:08d}"
        trainer_state = {
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "data": batches.state_dict(),
            "global_batch": self.global_batch,
            "nan_streak": state.nan_streak,
            "skipped_steps": state.skipped_steps,
            "seed": self.cfg.seed,
            "inputs": self.inputs,
        }
        save(self.last, backend, self.dist, trainer_state, self.model_cfg, self.tokenizer)
        if self.dist.is_main:
            prune(self.root, c.keep_last)
