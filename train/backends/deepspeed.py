"""DeepSpeed ZeRO stage 0-3 with optimizer/parameter offload to CPU or NVMe.

What Baton adds around DeepSpeed, and why:
- JIT-built ops (DeepSpeedCPUAdam, shared-memory comm, async_io) are built up front under a file
  lock, after removing a `lock` file that a killed build left behind (it hangs the next run), once
  per installation for all checkouts (deepspeed_ops.py).
- The shared-memory CPU allreduce is off unless asked for (deepspeed.shm_comm): gloo is the CPU
  default, and the op costs a one-time build of about a minute.
- A non-finite step is never applied: ZeRO 1-3 skip it themselves (invalid gradient norm); at
  stage 0 DeepSpeed steps the bare optimizer, so Baton hands it one that skips.
- bf16/fp16 are DeepSpeed's own sections (baton.train.deepspeed_config): the module runs in the
  compute dtype, the ZeRO optimizer (at stage 0 DeepSpeed's FP16_UnfusedOptimizer) steps float32
  master weights, gradients are reduced in float32. A resume through the universal form writes the
  float32 weights into those masters, not through the rounded module.
- Checkpoints are DeepSpeed's own sharded files. A checkpoint of another layout (world size,
  stage, offload or backend) is loaded through Baton's universal form, which DeepSpeed lacks for
  ZeRO-1/2. Under NVMe offload DeepSpeed's files lack the swapped state and its load_checkpoint
  silently skips the optimizer state, so Baton writes that state itself and always loads it
  through the universal form.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from baton.common.config import ConfigError, ModelConfig
from baton.common.corpus import cache_root
from baton.common.model import AttentionBackend, CausalLM
from baton.train.backends.base import Layout, StepResult, lm_loss, param_groups, step_loss
from baton.train.backends.deepspeed_ops import use_build_cache
from baton.train.backends.readers import read_any
from baton.train.backends.zero_checkpoint import GROUPS_FILE, NVME_STATE, TAG
from baton.train.compile import compile_layers
from baton.train.config import TrainConfig
from baton.train.deepspeed_config import ds_config
from baton.train.distributed import Dist
from baton.train.universal import MOMENTS, UniversalState

log = logging.getLogger(__name__)
warnings.filterwarnings("ignore", message=".*(all_gather_into_tensor|reduce_scatter_tensor).*", category=FutureWarning)


class _SkipNonFiniteAdamW(torch.optim.AdamW):
    """At stage 0 DeepSpeed calls the bare optimizer; `overflow` is what its engine reads to
    count a skipped step (ZeRO 1-3 optimizers set it themselves)."""

    overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.overflow = not all(torch.isfinite(g).all() for g in grads)
        return None if self.overflow else super().step(closure)


def uses_cpu_adam(cfg: TrainConfig) -> bool:
    d = cfg.deepspeed
    return d.offload_optimizer != "none" if d.cpu_adam is None else d.cpu_adam


def _builders(cfg: TrainConfig) -> list[Any]:
    from deepspeed.accelerator import get_accelerator

    d, acc = cfg.deepspeed, get_accelerator()
    names = ["CPUAdamBuilder"] if uses_cpu_adam(cfg) else []
    names += ["ShareMemCommBuilder"] if d.shm_comm and acc.device_name() == "cpu" else []
    names += ["AsyncIOBuilder"] if "nvme" in (d.offload_optimizer, d.offload_param) else []
    return [acc.create_op_builder(n) for n in names]


def check_environment(cfg: TrainConfig) -> None:
    """Errors DeepSpeed would give late (or never) are given before any work starts."""
    for b in _builders(cfg):
        if b is None or not b.is_compatible(verbose=False):
            hint = " (needs libaio: apt-get install libaio-dev)" if "async_io" in getattr(b, "NAME", "async_io") else ""
            raise ConfigError(f"DeepSpeed op {getattr(b, 'NAME', '?')} cannot be built on this machine{hint}")
    if cfg.precision != "fp32":
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        supported = acc.is_bf16_supported() if cfg.precision == "bf16" else acc.is_fp16_supported()
        if not supported:
            raise ConfigError(
                f"precision {cfg.precision}: DeepSpeed's {acc.device_name()} accelerator does not support it on "
                "this machine; use precision: bf16, or fp32"
            )
    d = cfg.deepspeed
    if d.nvme_path and "nvme" in (d.offload_optimizer, d.offload_param):
        Path(d.nvme_path).mkdir(parents=True, exist_ok=True)
        if not os.access(d.nvme_path, os.W_OK):
            raise ConfigError(f"deepspeed.nvme_path {d.nvme_path} is not writable")


def prepare_ops(cfg: TrainConfig) -> None:
    """Build (or load) the JIT ops this run needs, one process at a time.

    torch's extension builder marks a build in progress with a `lock` file and waits forever if
    one exists; a build killed midway leaves it behind. Every Baton process builds under an flock
    per op (released by the kernel when its holder dies), so a `lock` found while holding it is
    stale. (A build by a non-Baton process in the same folder is not protected.)
    """
    builders = _builders(cfg)
    if not builders:
        return
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cache_root() / "torch_extensions")
    folder = use_build_cache(root)  # one build per installation, shared by checkouts (deepspeed_ops.py)
    folder.mkdir(parents=True, exist_ok=True)
    for b in builders:
        with open(folder / f".{b.name}.baton-lock", "w") as held:  # one lock per op: builds of others go on
            fcntl.flock(held, fcntl.LOCK_EX)
            stale = folder / b.name / "lock"
            if stale.exists():
                log.warning("removing %s, left by an interrupted build of %s", stale, b.name)
                stale.unlink()
            log.info("loading DeepSpeed op %s (built once into %s; the first build takes minutes)", b.name, folder)
            b.load(verbose=False)


def _init_deepspeed(cfg: TrainConfig) -> None:
    """The ops this run needs, and DeepSpeed's communication (both idempotent)."""
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    prepare_ops(cfg)
    if not cfg.deepspeed.shm_comm:
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # checked before building it
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


@torch.no_grad()
def zero3_model(cfg: TrainConfig, model_cfg: ModelConfig, dist: Dist, weights: Mapping[str, torch.Tensor]) -> CausalLM:
    """A ZeRO-3 model holding `weights` that no rank ever holds whole: built under zero.Init (each
    module is partitioned as soon as it is made, in the compute dtype, on the offload device the
    config says), then each parameter gathered in turn, filled by rank 0 from the file and
    re-partitioned on leaving the context. At most one whole tensor is alive per rank at a time."""
    import deepspeed

    _init_deepspeed(cfg)
    with deepspeed.zero.Init(config_dict_or_path=ds_config(cfg, dist.world_size)):
        model = CausalLM(model_cfg)
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if dist.is_main:
                p.data.copy_(weights[name])
    for name, b in model.named_buffers():  # (DeepSeek-V3's correction biases: not partitioned, whole everywhere)
        if name in weights:
            b.copy_(weights[name])
    return model


class DeepSpeedBackend:
    def __init__(
        self,
        cfg: TrainConfig,
        model: CausalLM,
        attn: AttentionBackend,
        dist: Dist,
        pretrained: Mapping[str, torch.Tensor] | None = None,
    ):
        """`pretrained`: the float32 weights `model` was loaded from (init_from), read again for the
        float32 master weights under bf16/fp16, where the module holds them rounded."""
        import deepspeed

        d = cfg.deepspeed
        self.module, self.attn, self.dist, self.stage = model, attn, dist, d.stage
        self.nvme = d.offload_optimizer == "nvme"
        self.precision = cfg.precision
        self.layout = Layout("deepspeed", dist.world_size, d.stage, d.offload_optimizer, d.offload_param, cfg.precision)
        _init_deepspeed(cfg)
        groups, self.group_names = param_groups(model, cfg.optim.weight_decay)
        o = cfg.optim
        kw = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        if uses_cpu_adam(cfg):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
        else:
            optimizer = (_SkipNonFiniteAdamW if d.stage == 0 else torch.optim.AdamW)(groups, **kw)
        if cfg.compile:  # each layer's forward, before DeepSpeed wraps the model (ZeRO-3 refused by the recipe check)
            compile_layers(model)
        initial = None
        if cfg.precision != "fp32":
            initial = (
                pretrained if pretrained is not None else {n: p.detach().clone() for n, p in model.named_parameters()}
            )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config(cfg, dist.world_size), dist_init_required=False
        )
        if initial is not None:
            # DeepSpeed copies its float32 masters from the module already cast to bf16/fp16, and at
            # stage 0 FP16_UnfusedOptimizer steps the AdamW once on zero gradients to make its state
            # (weight decay shrinks the masters, and Adam's step count runs one ahead): start from the
            # exact float32 initial weights with no optimizer state, as the other backends do.
            self._load_weights(UniversalState(initial, {}, {}, 0))
            if self.stage == 0:
                self.engine.optimizer.optimizer.state.clear()

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        losses = []
        for i, batch in enumerate(micro_batches):
            batch = batch.to(self.engine.device)
            loss = lm_loss(self.engine(batch[:, :-1], attn=self.attn), batch)
            self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
            if i < len(micro_batches) - 1:
                self.engine.step()  # not a boundary: only advances DeepSpeed's micro-step count
            losses.append(loss.detach())
        loss = step_loss(self.dist, torch.stack(losses).sum(), len(micro_batches))
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        scale = float(self.engine.optimizer.loss_scale) if self.precision == "fp16" else None
        self.engine.step()  # the boundary: reduce, clip and update, or skip a non-finite step (fp16: an overflow)
        applied = self.engine.was_step_applied()
        if applied and not math.isfinite(loss):
            raise RuntimeError("DeepSpeed applied an update computed from a non-finite loss")
        norm = self.engine.get_global_grad_norm()
        overflow = scale is not None and not applied and math.isfinite(loss)
        return StepResult(loss, None if norm is None else float(norm), applied, scale, overflow)

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        self.engine.eval()
        batch = batch.to(self.engine.device)
        try:
            return lm_loss(self.engine(batch[:, :-1], attn=self.attn), batch).item()
        finally:
            self.engine.train()

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)
        if self.dist.is_main:
            (directory / GROUPS_FILE).write_text(json.dumps(self.group_names) + "\n")
        if self.nvme:
            self._save_swapped_state(directory / TAG)

    def _save_swapped_state(self, tag_dir: Path) -> None:
        """Under NVMe offload the fp32 partitions and Adam moments of swapped sub-groups are not in
        DeepSpeed's *_optim_states.pt (only its raw swap files are copied aside), so each rank swaps
        them in one sub-group at a time and writes them in ZeRO-3's flat layout."""
        from safetensors.torch import save_file

        zero = self.engine.optimizer
        flat: dict[str, torch.Tensor] = {}
        step = 0
        for i, fp32 in enumerate(zero.fp32_partitioned_groups_flat):
            swapped = zero._swappable_optimizer_subgroup(i)
            if swapped:
                zero._optimizer_states_and_gradient_swap_in(i)
            st = zero.optimizer.state[fp32]
            flat[f"fp32/{i}"] = fp32.detach().clone()
            for key in MOMENTS:
                flat[f"{key}/{i}"] = st[key].detach().clone()
            step = int(st["step"])
            if swapped:
                zero._release_swap_buffers(i)
        save_file(flat, tag_dir / NVME_STATE.format(rank=self.dist.rank), metadata={"step": str(step)})

    def load(self, directory: Path, saved: Layout) -> None:
        if saved == self.layout and not self.nvme:
            path, _ = self.engine.load_checkpoint(str(directory), tag=TAG, load_lr_scheduler_states=False)
            if path is None:
                raise RuntimeError(f"DeepSpeed could not load the checkpoint in {directory}")
            steps = [st["step"] for st in self.engine.optimizer.optimizer.state.values()] if self.stage else []
            self._replay_cpu_adam(int(max(steps, default=0)))
            return
        # Another layout, or NVMe offload, where DeepSpeed's load_checkpoint silently skips the
        # optimizer state: Baton loads the universal form itself.
        log.info("loading a %s checkpoint into layout %s through the universal form", saved, self.layout)
        state = read_any(directory, saved.backend)
        self._load_weights(state)
        self._load_optimizer(state)
        self._replay_cpu_adam(state.step)

    def _replay_cpu_adam(self, steps: int) -> None:
        """DeepSpeedCPUAdam's C++ side keeps beta^t as a running product, one multiplication per
        step; a fresh process would recompute it with pow() at the first step and drift from the
        uninterrupted run by an ulp, growing from there. Replaying the steps on a 1-element dummy
        rebuilds exactly the product the run had."""
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = self.engine.optimizer.optimizer if self.stage else self.engine.optimizer
        if not isinstance(opt, DeepSpeedCPUAdam):
            return
        g = opt.param_groups[0]
        dummy = [torch.zeros(1) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
        for t in range(1, steps + 1):
            opt.ds_opt_adam.adam_update(
                opt.opt_id, t, g["lr"], *g["betas"], g["eps"], g["weight_decay"], g["bias_correction"], *dummy
            )

    def _named(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.engine.module.named_parameters())

    @torch.no_grad()
    def _load_weights(self, state: UniversalState) -> None:
        import deepspeed

        for name, p in self._named().items():
            ctx = (
                deepspeed.zero.GatheredParameters([p], modifier_rank=0) if self.stage == 3 else contextlib.nullcontext()
            )
            with ctx:
                if self.stage < 3 or self.dist.is_main:
                    p.data.copy_(state.weights[name])  # rounded to the compute dtype, as DeepSpeed's own update does
        for name, b in self.engine.module.named_buffers():  # (the persistent ones: training state, whole everywhere)
            if name in state.weights:
                b.copy_(state.weights[name])
        if self.stage == 0 and self.precision != "fp32":  # FP16_UnfusedOptimizer: a float32 copy per parameter
            masters = (m for g in self.engine.optimizer.fp32_groups for m in g)
            for name, master in zip(self._in_group_order(), masters):
                master.copy_(state.weights[name])
        elif self.nvme or (self.stage > 0 and self.precision != "fp32"):
            # The float32 masters are set from the float32 weights (swap-aware under NVMe), not from the module.
            from deepspeed.utils import safe_set_full_fp32_param

            for name, p in self._named().items():
                safe_set_full_fp32_param(p, state.weights[name])
        elif self.stage > 0:
            self.engine.optimizer.refresh_fp32_params()  # the fp32 master copy follows the module

    def _in_group_order(self) -> list[str]:
        """Parameter names in the optimizer's group order (how DeepSpeed lists its master copies)."""
        return [n for group in self.group_names for n in group]

    def _load_optimizer(self, state: UniversalState) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        if state.step == 0:
            return
        if self.stage == 0:
            opt, named = self.engine.optimizer, self._named()
            if self.precision != "fp32":  # AdamW inside FP16_UnfusedOptimizer steps the float32 copies
                masters = (m for g in opt.fp32_groups for m in g)
                opt, named = opt.optimizer, dict(zip(self._in_group_order(), masters))
            opt.state.clear()
            for name, p in named.items():
                opt.state[p] = {
                    "step": torch.tensor(float(state.step), dtype=torch.float32),
                    "exp_avg": state.exp_avg[name].to(p.device, copy=True),
                    "exp_avg_sq": state.exp_avg_sq[name].to(p.device, copy=True),
                }
            return
        self._materialize_optimizer_state(state.step)
        for key in MOMENTS:
            for name, p in self._named().items():
                safe_set_full_optimizer_state(p, state.moments(key)[name], key)

    def _materialize_optimizer_state(self, step: int) -> None:
        """Adam creates its state at the first step, and DeepSpeed links each parameter to its
        slice of that state only then; a resumed run needs it before. So create it (ZeRO keeps
        one flat fp32 partition per group), set the step count, and have DeepSpeed link it."""
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        zero = self.engine.optimizer
        base = zero.optimizer
        flats = zero.fp32_partitioned_groups_flat if self.stage == 3 else zero.single_partition_of_fp32_groups
        for i, flat in enumerate(flats):
            swapped = self.stage == 3 and zero._swappable_optimizer_subgroup(i)  # NVMe: bring it into memory
            if swapped:
                zero._optimizer_states_and_gradient_swap_in(i)
            st = base.state[flat]
            for key in MOMENTS:
                st.setdefault(key, torch.zeros_like(flat))
            # DeepSpeedCPUAdam counts steps in an int, torch's AdamW in a float32 tensor.
            st["step"] = step if isinstance(base, DeepSpeedCPUAdam) else torch.tensor(float(step), dtype=torch.float32)
            if swapped:
                zero._optimizer_states_and_gradient_swap_out(i)  # ... and back, now with its state
        if self.stage < 3:
            zero._lazy_init_hp_params_optimizer_state()

    def memory(self) -> dict[str, Any]:
        from baton.train.backends.zero_memory import zero_memory

        return zero_memory(self)
