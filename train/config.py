"""Training recipe: the dataclasses a YAML recipe becomes, one per section, and TrainConfig.

Reading a recipe (YAML, key=value overrides) is baton.train.recipe; the checks that refuse a bad
one before a single weight is allocated are baton.train.validate; baton.train.overrides handles
the raw mappings. Nothing here imports them: every other module may import this one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from baton.common.config import ModelConfig
from baton.common.data import DataConfig
from baton.train.early_exit import EarlyExitConfig
from baton.train.model_section import model_config
from baton.train.mtp import MTPConfig, with_mtp
from baton.train.parallel.layout import ParallelConfig, data_parallel_rank, data_parallel_size

BACKENDS = ("torch", "deepspeed", "torch3d", "megatron")
LAYOUT_BACKENDS = ("torch3d", "megatron")  # the backends the parallel section lays out
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
    """backend megatron's own options (baton.train.backends.megatron). Its layout - tp x pp x dp,
    virtual stages, sequence parallelism - is the `parallel` section's, as for torch3d; the old
    megatron.tp/pp/vp/sequence_parallel keys are read there (baton.train.recipe, deprecated)."""

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
    """MoE training (baton.train.moe), ignored for dense models. None: the family's default.
    Softmax-routed families (Mixtral, Qwen3-MoE, gpt-oss) add Switch's load-balancing loss and ST-MoE's
    z-loss; deepseek_v3 (sigmoid scores plus a correction bias) balances as DeepSeek-V3 does instead:
    the bias moves against each expert's load error after every step (baton.train.balancing), with an
    optional small sequence-wise loss. Every loss is averaged over the MoE layers."""

    aux_loss_coef: float | None = None  # x Switch/Mixtral load balancing (k when balanced); None: 0.01
    z_loss_coef: float | None = None  # x router z-loss, mean logsumexp(router logits)^2; None: 0.001
    # deepseek_v3 only (the others have no correction bias):
    bias_update_rate: float | None = None  # the bias step per optimizer step (0: frozen); None: 0.001 (DeepSeek-V3)
    seq_aux_loss_coef: float | None = None  # x DeepSeek-V3's sequence-wise balance loss; None: 0.0001 (DeepSeek-V3)


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
    backend: str = "torch"  # torch (one process, or DDP under torchrun) | deepspeed | torch3d | megatron
    precision: str = "fp32"  # fp32 | bf16 | fp16 (dynamic loss scaling): compute dtype; fp32 master weights
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # precision fp16 only
    attention: str = "sdpa"  # sdpa | triton (Baton's Triton FlashAttention, CUDA) | eager: baton.train.attention
    compile: bool = False  # torch.compile every decoder layer's forward (baton.train.compile)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    # the dp x pp x cp x tp layout, for torch3d and megatron (megatron: no cp, pp_stages_per_rank = vp)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # backend megatron's own options
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)  # MoE models: router losses and expert balancing
    mtp: MTPConfig = field(default_factory=MTPConfig)  # DeepSeek-V3's multi-token prediction (baton.train.mtp)
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

    def data_parallel_size(self, world_size: int) -> int:
        """Model replicas sharing each global batch: every rank, except under the parallel
        section's tp/pp/cp (backends torch3d and megatron)."""
        return data_parallel_size(self.parallel, world_size) if self.backend in LAYOUT_BACKENDS else world_size

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        """Which share of each global batch `rank` trains on (megatron's rank order is tp fastest,
        then dp, then pp, as torch3d's mesh)."""
        return data_parallel_rank(self.parallel, rank, world_size) if self.backend in LAYOUT_BACKENDS else rank

    def accum_steps(self, data_parallel_size: int) -> int:
        if self.grad_accum_steps is not None:
            return self.grad_accum_steps
        if self.global_batch_size is None:
            return 1
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)

    def global_batch(self, data_parallel_size: int) -> int:
        return self.micro_batch_size * self.accum_steps(data_parallel_size) * data_parallel_size

    def model_config(self, vocab_size: int, exits: bool = True, **token_ids: Any) -> ModelConfig:
        """The model config; vocab size and special token ids come from the tokenizer (with
        init_from it is the checkpoint's; baton.train.model_section). `exits`: with the early exits
        this run trains recorded (early_exit.exit_layers); the MTP modules the `mtp` section trains."""
        cfg = model_config(self.model, self.init_from, self.early_exit.exit_layers, vocab_size, exits, token_ids)
        return with_mtp(cfg, self.mtp, self.init_from, self.model.get("num_nextn_predict_layers"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
