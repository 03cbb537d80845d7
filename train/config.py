"""Training recipe: dataclasses loaded from YAML (+ key=value overrides), validated up front.

Everything that can be wrong with a recipe (unknown keys, impossible batch arithmetic, missing
data, DeepSpeed settings that DeepSpeed would silently reinterpret, pass-throughs - deepspeed.extra,
the model section - that contradict the rest of the recipe) raises a ConfigError before a single
weight is allocated. Checks that need the world size run again at the start of training.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from baton.common.config import PRESETS, ConfigError, ModelConfig
from baton.common.data import DataConfig
from baton.train.attention import check_attention
from baton.train.deepspeed_config import check_ds_config, check_zero
from baton.train.distributed import read_launch
from baton.train.early_exit import EarlyExitConfig
from baton.train.hybrid import check_recipe as check_hybrid
from baton.train.parallel.layout import ParallelConfig, check_layout, data_parallel_rank, data_parallel_size

BACKENDS = ("torch", "deepspeed", "torch3d", "megatron")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
RECOMPUTE_MODES = ("none", "selective", "full")
# precision -> the dtype the forward and backward compute in (and the handoff is written in); the
# optimizer's master weights and the gradient reductions stay float32 in every mode.
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5  # cosine decays from lr to min_lr
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class LossScaleConfig:
    """precision fp16's dynamic loss scaler (torch.amp.GradScaler, or DeepSpeed's fp16 section)."""

    initial_power: int = 16  # the scale starts at 2**initial_power (both libraries' default: 65536)
    # Doubled after this many steps without overflow, halved on every overflow. (DeepSpeed counts the
    # window from the step after an overflow: it doubles one clean step later than GradScaler.)
    window: int = 1000


@dataclass
class TokenizerConfig:
    path: str | None = None  # a directory with tokenizer.json; None: train one on the data
    kind: str = "bpe"  # "bpe" (byte-level) or "char", when training one
    vocab_size: int = 1024  # for "bpe"


@dataclass
class DeepSpeedConfig:
    """ZeRO settings; baton.train.backends.deepspeed turns them into a DeepSpeed config."""

    stage: int = 0  # ZeRO stage 0 (plain data parallel) .. 3 (parameters sharded too)
    offload_optimizer: str = "none"  # none | cpu | nvme: where optimizer state and the step live
    offload_param: str = "none"  # none | cpu | nvme: where (ZeRO-3) parameters live between uses
    nvme_path: str | None = None  # a local folder on a fast disk, for nvme offload
    cpu_adam: bool | None = None  # DeepSpeedCPUAdam (a JIT-built op); None: when offloading the optimizer
    shm_comm: bool = False  # DeepSpeed's shared-memory CPU allreduce (JIT-built); False: plain gloo
    extra: dict[str, Any] = field(default_factory=dict)  # raw DeepSpeed config keys merged on top


@dataclass
class MegatronConfig:
    """backend megatron's layout and options (baton.train.backends.megatron): tp x pp x dp, dp the rest."""

    tp: int = 1  # tensor parallel: heads, MLP width and vocabulary split across ranks
    pp: int = 1  # pipeline parallel: layers split into stages
    vp: int = 1  # virtual pipeline stages per pipeline rank (> 1: the interleaved 1F1B schedule)
    sequence_parallel: bool = False  # with tp > 1: norms and residuals sharded along the sequence
    recompute: str = "none"  # none | selective (the attention core) | full (every layer)
    distributed_optimizer: bool = False  # optimizer state (and fp32 master weights) sharded over dp


@dataclass
class RecomputeConfig:
    mode: str = "none"  # none | selective (attention core only, Megatron) | full (whole layers)
    every_n_layers: int = 1  # full: recompute layers 0, N, 2N, ...


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0: only at the end)
    keep_last: int = 2  # older step checkpoints are deleted
    resume: str = "auto"  # auto: the latest under out_dir/checkpoints, if any; never; or a path
    # Resume even if the data, tokenizer, seq_len or seed differ from the checkpoint's (each is warned about).
    allow_resume_mismatch: bool = False


@dataclass
class MoEConfig:
    """Router losses of MoE models (baton.train.moe), each averaged over the MoE layers; ignored
    for dense models. Defaults: Switch's load-balancing alpha and ST-MoE's z-loss coefficient."""

    aux_loss_coef: float = 0.01  # x Switch/Mixtral load-balancing loss (k when balanced)
    z_loss_coef: float = 0.001  # x router z-loss, mean logsumexp(router logits)^2


@dataclass
class LoggingConfig:
    progress: bool = True  # a tqdm bar on rank 0
    tensorboard: bool = True  # event files under out_dir/tensorboard
    plot: bool = True  # out_dir/loss.png at the end
    mfu: bool = True  # measure the machine's matmul peak (~1 s) and report MFU against it


@dataclass
class TrainConfig:
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "demo"})
    # Fine-tune: start from this HF checkpoint directory or Baton handoff (its model, weights and
    # tokenizer; fresh optimizer and data). baton.train.pretrained
    init_from: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    backend: str = "torch"  # torch (single process, or DDP under torchrun) | deepspeed
    precision: str = "fp32"  # fp32 | bf16 | fp16 (dynamic loss scaling): compute dtype; fp32 master weights
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # precision fp16 only
    attention: str = "sdpa"  # sdpa | triton (Baton's Triton FlashAttention, CUDA) | eager: baton.train.attention
    compile: bool = False  # torch.compile every decoder layer's forward (baton.train.compile)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # torch3d: the dp x pp x cp x tp layout
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # backend megatron: layout and options
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)  # MoE models: router loss coefficients
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)  # LayerSkip (baton.train.early_exit)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    micro_batch_size: int = 8
    grad_accum_steps: int | None = None  # None: global_batch_size / (micro x data-parallel size), else 1
    global_batch_size: int | None = None  # if set, must equal micro x accum x data-parallel size
    max_steps: int = 1000
    eval_interval: int = 100
    eval_batches: int = 8
    log_interval: int = 10
    max_nan_steps: int = 5  # stop after this many non-finite losses in a row (each step is skipped)
    export: bool = True  # write the handoff checkpoint (out_dir/handoff) at the end
    out_dir: str = "runs/default"
    seed: int = 1234

    def __post_init__(self) -> None:
        self.validate()

    def data_parallel_size(self, world_size: int) -> int:
        """Model replicas sharing each global batch: every rank, except under torch3d's tp/pp/cp and
        megatron's tp/pp."""
        if self.backend == "megatron":
            return max(1, world_size // (self.megatron.tp * self.megatron.pp))
        return data_parallel_size(self.parallel, world_size) if self.backend == "torch3d" else world_size

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        """Which share of each global batch `rank` trains on (megatron's rank order is tp fastest,
        then dp, then pp, as torch3d's mesh)."""
        if self.backend == "megatron":
            return (rank // self.megatron.tp) % self.data_parallel_size(world_size)
        return data_parallel_rank(self.parallel, rank, world_size) if self.backend == "torch3d" else rank

    def accum_steps(self, data_parallel_size: int) -> int:
        if self.grad_accum_steps is not None:
            return self.grad_accum_steps
        if self.global_batch_size is None:
            return 1
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)

    def global_batch(self, data_parallel_size: int) -> int:
        return self.micro_batch_size * self.accum_steps(data_parallel_size) * data_parallel_size

    def validate(self, data_parallel_size: int | None = None) -> None:
        """Raise ConfigError on the first problem; the batch arithmetic needs the world size."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"invalid training config: {msg}")

        for name in ("micro_batch_size", "max_steps", "eval_batches", "log_interval", "max_nan_steps"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
        a = self.grad_accum_steps
        need(
            a is None or (isinstance(a, int) and a > 0),
            f"grad_accum_steps must be a positive integer or null, got {a!r}",
        )
        need(
            isinstance(self.eval_interval, int) and self.eval_interval >= 0,
            "eval_interval must be >= 0 (0: only at the end)",
        )
        self._validate_batch(need, data_parallel_size)
        o = self.optim
        need(o.lr > 0 and 0 <= o.min_lr <= o.lr, f"need 0 <= min_lr ({o.min_lr}) <= lr ({o.lr}) and lr > 0")
        need(
            0 <= o.warmup_steps <= self.max_steps,
            f"warmup_steps {o.warmup_steps} must be in 0..max_steps {self.max_steps}",
        )
        need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "betas must be in [0, 1)")
        need(o.grad_clip >= 0 and o.weight_decay >= 0, "grad_clip and weight_decay must be >= 0")
        need(
            self.tokenizer.kind in ("bpe", "char"),
            f"tokenizer.kind must be 'bpe' or 'char', got {self.tokenizer.kind!r}",
        )
        need(
            self.tokenizer.vocab_size >= 260 or self.tokenizer.kind == "char",
            "tokenizer.vocab_size must be >= 260 for byte-level BPE (256 bytes + specials)",
        )
        if self.tokenizer.path is not None:
            need(
                (Path(self.tokenizer.path) / "tokenizer.json").is_file(),
                f"tokenizer.path {self.tokenizer.path} has no tokenizer.json",
            )
        self._validate_init_from(need)
        self._validate_early_exit(need)
        self._validate_model(need)
        check_hybrid(need, self, self.model_config(vocab_size=self.model.get("vocab_size", 1024)).is_hybrid)
        self._validate_precision(need)
        self._validate_compute(need)
        self._validate_backend(need, data_parallel_size)
        self._validate_parallel(need)
        self._validate_megatron(need)
        self._validate_moe(need)
        r = self.recompute
        need(r.mode in RECOMPUTE_MODES, f"recompute.mode must be one of {RECOMPUTE_MODES}, got {r.mode!r}")
        need(
            isinstance(r.every_n_layers, int) and r.every_n_layers > 0,
            "recompute.every_n_layers must be a positive integer",
        )
        c = self.checkpoint
        need(isinstance(c.interval, int) and c.interval >= 0, "checkpoint.interval must be >= 0 (0: only at the end)")
        need(isinstance(c.keep_last, int) and c.keep_last >= 1, "checkpoint.keep_last must be >= 1")
        need(
            c.resume in ("auto", "never") or Path(c.resume).is_dir(),
            f"checkpoint.resume must be 'auto', 'never' or an existing checkpoint directory, got {c.resume!r}",
        )

    def _validate_batch(self, need, dp: int | None) -> None:
        m, a, g = self.micro_batch_size, self.grad_accum_steps, self.global_batch_size
        if g is None:
            return
        need(isinstance(g, int) and g > 0, f"global_batch_size must be a positive integer, got {g!r}")
        if dp is None:  # world size unknown yet: only what holds for every world size
            need(
                g % (m * (a or 1)) == 0,
                f"global_batch_size {g} is not a multiple of micro_batch_size {m}"
                + (f" x grad_accum_steps {a}" if a else ""),
            )
            return
        if a is None:
            need(
                g % (m * dp) == 0,
                f"global_batch_size {g} is not divisible by micro_batch_size {m} x "
                f"data-parallel size {dp}, so no whole number of accumulation steps fits",
            )
        else:
            need(
                g == m * a * dp,
                f"global_batch_size {g} != micro_batch_size {m} x grad_accum_steps {a} x "
                f"data-parallel size {dp} = {m * a * dp}",
            )

    def _validate_init_from(self, need) -> None:
        d = self.init_from
        if d is None:
            return
        need(isinstance(d, str) and Path(d).is_dir(), f"init_from must be a checkpoint directory, got {d!r}")
        need((Path(d) / "config.json").is_file(), f"init_from {d} is not a checkpoint directory (no config.json)")
        need(
            (Path(d) / "tokenizer.json").is_file() or self.tokenizer.path is not None,
            f"init_from {d} has no tokenizer.json: set tokenizer.path to the tokenizer the model was trained with",
        )

    def _validate_model(self, need) -> None:
        model = dict(self.model)
        name = model.pop("preset", None)
        need(name is None or name in PRESETS, f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        mc = self.model_config(vocab_size=model.get("vocab_size", 1024))  # raises on a bad model section
        need(
            mc.torch_dtype == "float32",
            f"training keeps float32 weights (model.torch_dtype {mc.torch_dtype!r}): they are the optimizer's "
            "master weights; to compute in bfloat16 or float16 set precision: bf16 or fp16 instead (the "
            "handoff is then written in that dtype)",
        )
        need(
            self.data.seq_len <= mc.max_position_embeddings,
            f"data.seq_len {self.data.seq_len} exceeds the model's max_position_embeddings {mc.max_position_embeddings}",
        )

    def _validate_precision(self, need) -> None:
        """What each backend can run; fp16 needs a loss scaler, which torch3d's DTensor shards lack."""
        p = self.precision
        need(p in PRECISIONS, f"precision must be one of {tuple(PRECISIONS)}, got {p!r}")
        need(
            not (p == "fp16" and self.backend == "torch3d"),
            "precision fp16 needs a dynamic loss scaler, and backend torch3d has none for its DTensor/FSDP2 "
            "shards (torchtitan neither): use precision: bf16 (no scaler needed), or fp16 with backend "
            "torch or deepspeed",
        )
        need(
            not (p == "fp16" and self.backend == "deepspeed" and self.deepspeed.stage == 0),
            "precision fp16 at deepspeed.stage 0: DeepSpeed 0.19's engine.backward scales the loss only for "
            "ZeRO optimizers, so FP16_UnfusedOptimizer (stage 0) unscales gradients that were never scaled "
            "and every update comes out divided by the loss scale; use deepspeed.stage >= 1, backend torch, "
            "or precision bf16",
        )
        ls = self.loss_scale
        need(
            p == "fp16" or ls == LossScaleConfig(),
            f"the loss_scale section needs precision: fp16 (precision is {p!r}; bf16 and fp32 need no scaler)",
        )
        need(
            isinstance(ls.initial_power, int) and 0 <= ls.initial_power <= 64,
            f"loss_scale.initial_power must be an integer in 0..64, got {ls.initial_power!r}",
        )
        need(
            isinstance(ls.window, int) and ls.window > 0,
            f"loss_scale.window must be a positive integer, got {ls.window!r}",
        )

    def _validate_compute(self, need) -> None:
        """The attention core and torch.compile: what this machine and backend can run."""
        check_attention(need, self.attention, self.precision, self.parallel.cp)
        need(isinstance(self.compile, bool), f"compile must be true or false, got {self.compile!r}")
        if not self.compile:
            return
        from baton.train.compile import cpu_compiler

        need(
            torch.cuda.is_available() or cpu_compiler() is not None,
            "compile: true on CPU needs a C++ compiler for inductor's kernels (none of g++, c++, clang++ "
            "is on PATH): install one, or set compile: false",
        )
        need(
            not (self.backend == "deepspeed" and self.deepspeed.stage == 3),
            "compile: true with deepspeed.stage 3: ZeRO-3 gathers each parameter in hooks on every Linear "
            "inside the layer, which dynamo would trace; use stage 0-2, or backend torch3d (FSDP2) for "
            "sharded parameters with compiled layers",
        )

    def _validate_backend(self, need, dp: int | None) -> None:
        need(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        d = self.deepspeed
        need(d.stage in (0, 1, 2, 3), f"deepspeed.stage must be 0, 1, 2 or 3, got {d.stage!r}")
        for name in ("offload_optimizer", "offload_param"):
            v = getattr(d, name)
            need(v in OFFLOAD_DEVICES, f"deepspeed.{name} must be one of {OFFLOAD_DEVICES}, got {v!r}")
        if self.backend != "deepspeed":  # the section would be ignored: say so rather than train without it
            need(d.offload_optimizer == d.offload_param == "none", "offload needs backend: deepspeed")
            default = DeepSpeedConfig()
            changed = [f.name for f in dataclasses.fields(d) if getattr(d, f.name) != getattr(default, f.name)]
            need(
                not changed,
                f"deepspeed.{', deepspeed.'.join(changed)} set, but backend is {self.backend!r}: "
                "the deepspeed section needs backend: deepspeed",
            )
            return
        check_zero(
            need,
            d.stage,
            d.offload_optimizer,
            d.offload_param,
            d.nvme_path,
            {k: f"deepspeed.{k}" for k in ("stage", "offload_optimizer", "offload_param", "nvme_path")},
        )
        need(
            not (d.cpu_adam and d.offload_optimizer == "none"),
            "deepspeed.cpu_adam runs the optimizer on the host: it needs offload_optimizer cpu or nvme",
        )
        # deepspeed.extra is merged on top: what DeepSpeed will really run is checked, not just Baton's keys.
        check_ds_config(need, self, dp if dp is not None else read_launch().world_size)

    def _validate_moe(self, need) -> None:
        m = self.moe
        for name in ("aux_loss_coef", "z_loss_coef"):
            v = getattr(m, name)
            need(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                f"moe.{name} must be a number >= 0, got {v!r}",
            )
        routed = self.model_config(vocab_size=self.model.get("vocab_size", 1024)).num_local_experts > 0
        need(
            not (self.precision == "fp16" and routed and (m.aux_loss_coef or m.z_loss_coef)),
            "precision fp16 with MoE router losses: their gradient is injected beside the loss, where the "
            "dynamic loss scale is not applied; use precision bf16, or set moe.aux_loss_coef and "
            "moe.z_loss_coef to 0",
        )

    def _validate_early_exit(self, need) -> None:
        """LayerSkip's hooks need the whole model in one module whose loss the backend computes."""
        ee = self.early_exit
        depth = self.model_config(vocab_size=self.model.get("vocab_size", 1024), exits=False).num_hidden_layers
        ee.check(need, depth)
        need(
            not ee.enabled or self.backend == "torch",
            f"early_exit needs backend: torch (one process or DDP), not {self.backend!r}: the exits read "
            "every layer's output and the shared LM head, which the sharded and pipelined backends split",
        )

    def _validate_parallel(self, need) -> None:
        """The layout, checked with the launcher's (or srun's) world size before any process group exists
        (the vocabulary is not known yet, and no layout check depends on it)."""
        if self.backend != "torch3d":
            need(self.parallel == ParallelConfig(), "the parallel section needs backend: torch3d")
            return
        world = read_launch().world_size
        accum = self.accum_steps(data_parallel_size(self.parallel, world))
        check_layout(
            self.parallel,
            self.model_config(vocab_size=self.model.get("vocab_size", 1024)),
            world,
            max(1, accum),
            self.data.seq_len,
        )

    def _validate_megatron(self, need) -> None:
        """backend megatron: megatron-core present at the pinned version, the layout against the
        launcher's world size and the model, options megatron would reject or silently ignore."""
        m = self.megatron
        if self.backend != "megatron":
            need(m == MegatronConfig(), "the megatron section needs backend: megatron")
            return
        from baton.train.backends.megatron import check_recipe

        check_recipe(need, self)

    def model_config(self, vocab_size: int, exits: bool = True, **token_ids: Any) -> ModelConfig:
        """The model config; vocab size and special token ids come from the tokenizer. The recipe's
        model section may pad the vocabulary, but not shrink it below the tokenizer's or give the
        special tokens other ids: the embedding would be indexed out of range, or train the wrong rows.
        With init_from it is the checkpoint's (the checks call this without token ids, before the
        tokenizer is known; the trainer with them, and the tokenizer must fit the embedding).
        `exits`: with the early exits this run trains recorded (early_exit.exit_layers)."""
        if self.init_from is not None:
            from baton.train.pretrained import checkpoint_config, with_tokenizer

            section = {} if self.model == {"preset": "demo"} else self.model  # the default: no model section
            cfg = checkpoint_config(self.init_from, section)
            cfg = with_tokenizer(cfg, self.init_from, vocab_size, token_ids) if token_ids else cfg
            return self._with_exits(cfg) if exits else cfg
        model = dict(self.model)
        base = PRESETS.get(model.pop("preset", None), {})
        v = model.get("vocab_size", vocab_size)
        if not isinstance(v, int) or v < vocab_size:
            raise ConfigError(
                f"model.vocab_size {v!r} is smaller than the tokenizer's vocabulary of {vocab_size}: "
                "drop it (the tokenizer sets it) or make it larger"
            )
        for name, tid in token_ids.items():
            if name in model and model[name] != tid:
                raise ConfigError(
                    f"model.{name} {model[name]!r} disagrees with the tokenizer's {tid!r}: drop it "
                    "(the tokenizer sets it)"
                )
        cfg = ModelConfig.from_dict({**base, "vocab_size": vocab_size, **token_ids, **model})
        return self._with_exits(cfg) if exits else cfg

    def _with_exits(self, cfg: ModelConfig) -> ModelConfig:
        """The model config with the early exits this run trains (recorded in the handoff)."""
        if not self.early_exit.exit_layers:
            return cfg
        return dataclasses.replace(cfg, early_exit_layers=list(self.early_exit.exit_layers))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "optim": OptimConfig,
    "loss_scale": LossScaleConfig,
    "deepspeed": DeepSpeedConfig,
    "recompute": RecomputeConfig,
    "moe": MoEConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "parallel": ParallelConfig,
    "megatron": MegatronConfig,
    "early_exit": EarlyExitConfig,
}


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) in {where}: {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    return cls(**raw)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = tree.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
        tree = node
    tree[leaf] = value


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A copy of the recipe with each dotted key=value override (a YAML value) set."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. optim.lr=1e-3)")
        key, value = item.split("=", 1)
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str) and _EXPONENT.fullmatch(value.strip()):
            parsed = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        _set(raw, key.strip(), parsed)
    return raw


def config_from_dict(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    raw = apply_overrides(raw, overrides)
    top = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise ConfigError(f"unknown key(s) in training config: {', '.join(unknown)} (known: {', '.join(sorted(top))})")
    try:
        sections = {k: _build(cls, raw.pop(k) or {}, k) for k, cls in _SECTIONS.items() if k in raw}
        return TrainConfig(**raw, **sections)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e


def _read_recipe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"training config {path} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a YAML mapping at the top level")
    return raw


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    return config_from_dict(_read_recipe(path), overrides)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """What `baton train` runs: a model recipe (TrainConfig), or - when the recipe has a top-level
    `medusa:` section - Medusa heads for a frozen handoff checkpoint (MedusaTrainConfig), or - with
    a `router:` section - a Composition-of-Experts prompt router (RouterTrainConfig), or - with an
    `eagle:` section - an EAGLE draft head for a frozen handoff checkpoint (EagleTrainConfig)."""
    raw = _read_recipe(path)
    if "eagle" in raw:
        from baton.train.eagle import eagle_config_from_dict

        return eagle_config_from_dict(raw, overrides)
    if "medusa" in raw:
        from baton.train.medusa import medusa_config_from_dict

        return medusa_config_from_dict(raw, overrides)
    if "router" in raw:
        from baton.train.router import router_config_from_dict

        return router_config_from_dict(raw, overrides)
    return config_from_dict(raw, overrides)
