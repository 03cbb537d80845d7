"""The recipe checks: everything that can be wrong with a TrainConfig (impossible batch arithmetic,
missing data, a layout the world size cannot hold, DeepSpeed settings that DeepSpeed would
silently reinterpret, pass-throughs - deepspeed.extra, the model section - that contradict the rest
of the recipe) raises a ConfigError before a single weight is allocated.

baton.train.recipe runs `validate` on every recipe it reads (the world size from the launcher's
environment); the trainer runs it again with the world size of the process group it joins.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from baton.common.config import PRESETS, ConfigError
from baton.train.attention import check_attention
from baton.train.config import (
    BACKENDS,
    LAYOUT_BACKENDS,
    OFFLOAD_DEVICES,
    PRECISIONS,
    RECOMPUTE_MODES,
    DeepSpeedConfig,
    LossScaleConfig,
    MegatronConfig,
    TrainConfig,
)
from baton.train.deepspeed_config import check_ds_config, check_zero
from baton.train.distributed import read_launch
from baton.train.hybrid import check_recipe as check_hybrid
from baton.train.moe import coefficient
from baton.train.parallel.layout import ParallelConfig, check_layout


def validate(cfg: TrainConfig, data_parallel_size: int | None = None) -> None:
    """Raise ConfigError on the first problem; the batch arithmetic needs the world size."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(f"invalid training config: {msg}")

    for name in ("micro_batch_size", "max_steps", "eval_batches", "log_interval", "max_nan_steps"):
        v = getattr(cfg, name)
        need(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
    a = cfg.grad_accum_steps
    need(
        a is None or (isinstance(a, int) and a > 0),
        f"grad_accum_steps must be a positive integer or null, got {a!r}",
    )
    need(
        isinstance(cfg.eval_interval, int) and cfg.eval_interval >= 0,
        "eval_interval must be >= 0 (0: only at the end)",
    )
    _check_batch(cfg, need, data_parallel_size)
    o = cfg.optim
    need(o.lr > 0 and 0 <= o.min_lr <= o.lr, f"need 0 <= min_lr ({o.min_lr}) <= lr ({o.lr}) and lr > 0")
    need(
        0 <= o.warmup_steps <= cfg.max_steps,
        f"warmup_steps {o.warmup_steps} must be in 0..max_steps {cfg.max_steps}",
    )
    need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "betas must be in [0, 1)")
    need(o.grad_clip >= 0 and o.weight_decay >= 0, "grad_clip and weight_decay must be >= 0")
    need(
        cfg.tokenizer.kind in ("bpe", "char"),
        f"tokenizer.kind must be 'bpe' or 'char', got {cfg.tokenizer.kind!r}",
    )
    need(
        cfg.tokenizer.vocab_size >= 260 or cfg.tokenizer.kind == "char",
        "tokenizer.vocab_size must be >= 260 for byte-level BPE (256 bytes + specials)",
    )
    if cfg.tokenizer.path is not None:
        need(
            (Path(cfg.tokenizer.path) / "tokenizer.json").is_file(),
            f"tokenizer.path {cfg.tokenizer.path} has no tokenizer.json",
        )
    _check_init_from(cfg, need)
    _check_early_exit(cfg, need)
    _check_model(cfg, need)
    check_hybrid(need, cfg, cfg.model_config(vocab_size=cfg.model.get("vocab_size", 1024)).is_hybrid)
    _check_precision(cfg, need)
    _check_compute(cfg, need)
    _check_backend(cfg, need, data_parallel_size)
    _check_attention_features(cfg, need)
    _check_mtp(cfg, need)  # (before the layout's arithmetic: its refusals say why MTP cannot be split)
    _check_parallel(cfg, need)
    _check_megatron(cfg, need)
    _check_moe(cfg, need)
    r = cfg.recompute
    need(r.mode in RECOMPUTE_MODES, f"recompute.mode must be one of {RECOMPUTE_MODES}, got {r.mode!r}")
    need(
        isinstance(r.every_n_layers, int) and r.every_n_layers > 0,
        "recompute.every_n_layers must be a positive integer",
    )
    c = cfg.checkpoint
    need(isinstance(c.interval, int) and c.interval >= 0, "checkpoint.interval must be >= 0 (0: only at the end)")
    need(isinstance(c.keep_last, int) and c.keep_last >= 1, "checkpoint.keep_last must be >= 1")
    need(
        c.resume in ("auto", "never") or Path(c.resume).is_dir(),
        f"checkpoint.resume must be 'auto', 'never' or an existing checkpoint directory, got {c.resume!r}",
    )


def _check_batch(cfg: TrainConfig, need, dp: int | None) -> None:
    m, a, g = cfg.micro_batch_size, cfg.grad_accum_steps, cfg.global_batch_size
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


def _check_init_from(cfg: TrainConfig, need) -> None:
    d = cfg.init_from
    if d is None:
        return
    need(isinstance(d, str) and Path(d).is_dir(), f"init_from must be a checkpoint directory, got {d!r}")
    need((Path(d) / "config.json").is_file(), f"init_from {d} is not a checkpoint directory (no config.json)")
    need(
        (Path(d) / "tokenizer.json").is_file() or cfg.tokenizer.path is not None,
        f"init_from {d} has no tokenizer.json: set tokenizer.path to the tokenizer the model was trained with",
    )


def _check_model(cfg: TrainConfig, need) -> None:
    model = dict(cfg.model)
    name = model.pop("preset", None)
    need(name is None or name in PRESETS, f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    mc = cfg.model_config(vocab_size=model.get("vocab_size", 1024))  # raises on a bad model section
    need(
        mc.torch_dtype == "float32",
        f"training keeps float32 weights (model.torch_dtype {mc.torch_dtype!r}): they are the optimizer's "
        "master weights; to compute in bfloat16 or float16 set precision: bf16 or fp16 instead (the "
        "handoff is then written in that dtype)",
    )
    need(
        cfg.data.seq_len <= mc.max_position_embeddings,
        f"data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings {mc.max_position_embeddings}",
    )


def _check_precision(cfg: TrainConfig, need) -> None:
    """What each backend can run; fp16 needs a loss scaler, which torch3d's DTensor shards lack."""
    p = cfg.precision
    need(p in PRECISIONS, f"precision must be one of {tuple(PRECISIONS)}, got {p!r}")
    need(
        not (p == "fp16" and cfg.backend == "torch3d"),
        "precision fp16 needs a dynamic loss scaler, and backend torch3d has none for its DTensor/FSDP2 "
        "shards (torchtitan neither): use precision: bf16 (no scaler needed), or fp16 with backend "
        "torch or deepspeed",
    )
    need(
        not (p == "fp16" and cfg.backend == "deepspeed" and cfg.deepspeed.stage == 0),
        "precision fp16 at deepspeed.stage 0: DeepSpeed 0.19's engine.backward scales the loss only for "
        "ZeRO optimizers, so FP16_UnfusedOptimizer (stage 0) unscales gradients that were never scaled "
        "and every update comes out divided by the loss scale; use deepspeed.stage >= 1, backend torch, "
        "or precision bf16",
    )
    ls = cfg.loss_scale
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


def _check_compute(cfg: TrainConfig, need) -> None:
    """The attention core and torch.compile: what this machine and backend can run."""
    check_attention(need, cfg.attention, cfg.precision, cfg.parallel.cp)
    need(isinstance(cfg.compile, bool), f"compile must be true or false, got {cfg.compile!r}")
    if not cfg.compile:
        return
    from baton.train.compile import cpu_compiler

    need(
        torch.cuda.is_available() or cpu_compiler() is not None,
        "compile: true on CPU needs a C++ compiler for inductor's kernels (none of g++, c++, clang++ "
        "is on PATH): install one, or set compile: false",
    )
    need(
        not (cfg.backend == "deepspeed" and cfg.deepspeed.stage == 3),
        "compile: true with deepspeed.stage 3: ZeRO-3 gathers each parameter in hooks on every Linear "
        "inside the layer, which dynamo would trace; use stage 0-2, or backend torch3d (FSDP2) for "
        "sharded parameters with compiled layers",
    )


def _check_backend(cfg: TrainConfig, need, dp: int | None) -> None:
    need(cfg.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {cfg.backend!r}")
    d = cfg.deepspeed
    need(d.stage in (0, 1, 2, 3), f"deepspeed.stage must be 0, 1, 2 or 3, got {d.stage!r}")
    for name in ("offload_optimizer", "offload_param"):
        v = getattr(d, name)
        need(v in OFFLOAD_DEVICES, f"deepspeed.{name} must be one of {OFFLOAD_DEVICES}, got {v!r}")
    if cfg.backend != "deepspeed":  # the section would be ignored: say so rather than train without it
        need(d.offload_optimizer == d.offload_param == "none", "offload needs backend: deepspeed")
        default = DeepSpeedConfig()
        changed = [f.name for f in dataclasses.fields(d) if getattr(d, f.name) != getattr(default, f.name)]
        need(
            not changed,
            f"deepspeed.{', deepspeed.'.join(changed)} set, but backend is {cfg.backend!r}: "
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
    check_ds_config(need, cfg, dp if dp is not None else read_launch().world_size)


def _check_moe(cfg: TrainConfig, need) -> None:
    """The moe section against the model's routing: Switch's loss and the z-loss are a softmax router's,
    the correction bias and the sequence-wise loss DeepSeek-V3's (baton.train.moe, baton.train.balancing)."""
    m = cfg.moe
    for f in dataclasses.fields(m):
        v = getattr(m, f.name)
        need(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0),
            f"moe.{f.name} must be a number >= 0 (or null: the model's default), got {v!r}",
        )
    mc = cfg.model_config(vocab_size=cfg.model.get("vocab_size", 1024))
    routed = mc.num_local_experts > 0
    deepseek = routed and mc.model_type == "deepseek_v3"
    for name, why in (
        (
            "aux_loss_coef",
            "Switch's load-balancing loss takes the softmax of the router logits as routing probabilities",
        ),
        ("z_loss_coef", "the router z-loss bounds a softmax router's logsumexp"),
    ):
        need(
            not (deepseek and getattr(m, name)),
            f"moe.{name} {getattr(m, name)} with deepseek_v3: {why}, and DeepSeek-V3 routes by sigmoid affinities "
            "with a bias-corrected choice; it balances with moe.bias_update_rate (auxiliary-loss-free) and "
            "moe.seq_aux_loss_coef (its sequence-wise loss): leave moe.aux_loss_coef and moe.z_loss_coef unset or 0",
        )
    for name in ("bias_update_rate", "seq_aux_loss_coef"):
        need(
            deepseek or not getattr(m, name),
            f"moe.{name} {getattr(m, name)}: DeepSeek-V3's balancing needs its routed experts and their score "
            f"correction bias (model_type deepseek_v3 with experts), not model_type {mc.model_type!r}"
            + ("" if routed else " without experts"),
        )
    losses = [coefficient(getattr(m, n), n, deepseek) for n in ("aux_loss_coef", "z_loss_coef", "seq_aux_loss_coef")]
    need(
        not (cfg.precision == "fp16" and routed and any(losses)),
        "precision fp16 with MoE router losses: their gradient is injected beside the loss, where the "
        "dynamic loss scale is not applied; use precision bf16, or set moe.aux_loss_coef and "
        "moe.z_loss_coef to 0" + (" (deepseek_v3: moe.seq_aux_loss_coef)" if deepseek else ""),
    )


def _check_mtp(cfg: TrainConfig, need) -> None:
    """DeepSeek-V3's MTP modules (baton.train.mtp) train where the whole model runs as one module
    per rank, its final hidden states, head and sequences whole."""
    mc = cfg.model_config(vocab_size=cfg.model.get("vocab_size", 1024))
    cfg.mtp.check(need, mc)
    if mc.num_nextn_predict_layers == 0:
        return
    where = f"{mc.num_nextn_predict_layers} MTP module(s) (mtp.num_layers 0 trains none)"
    need(
        cfg.precision != "fp16",
        f"precision fp16 with {where}: their loss's gradient is injected beside the main loss, where the dynamic "
        "loss scale is not applied; use precision bf16",
    )
    need(
        not cfg.early_exit.enabled,
        f"early_exit with {where}: both train extra heads on the final hidden states; use one of them",
    )
    p = cfg.parallel
    if cfg.backend == "torch3d":
        for key, why in (
            ("pp", "the modules follow the last layer but read the first stage's embedding"),
            ("tp", "they need the whole hidden states and logits, which tensor parallelism shards"),
            ("cp", "module k's targets lie k tokens on, across the context-parallel shards"),
        ):
            need(getattr(p, key) == 1, f"parallel.{key} {getattr(p, key)} with {where}: {why}; use parallel.{key} 1")


def _check_early_exit(cfg: TrainConfig, need) -> None:
    """LayerSkip's hooks need the whole model in one module whose loss the backend computes."""
    ee = cfg.early_exit
    depth = cfg.model_config(vocab_size=cfg.model.get("vocab_size", 1024), exits=False).num_hidden_layers
    ee.check(need, depth)
    need(
        not ee.enabled or cfg.backend == "torch",
        f"early_exit needs backend: torch (one process or DDP), not {cfg.backend!r}: the exits read "
        "every layer's output and the shared LM head, which the sharded and pipelined backends split",
    )


def _check_parallel(cfg: TrainConfig, need) -> None:
    """torch3d's layout, checked with the launcher's (or srun's) world size before any process group
    exists (the vocabulary is not known yet, and no layout check depends on it). Backend megatron
    checks the same section its own way (_check_megatron)."""
    if cfg.backend not in LAYOUT_BACKENDS:
        need(cfg.parallel == ParallelConfig(), "the parallel section needs backend: torch3d or megatron")
        return
    if cfg.backend != "torch3d":
        return
    mc = cfg.model_config(vocab_size=cfg.model.get("vocab_size", 1024))
    if mc.is_mla:
        p = cfg.parallel
        need(
            p.tp == 1,
            f"parallel.tp {p.tp} with model_type {mc.model_type!r}: tensor parallelism's plans split q_proj/k_proj/"
            "v_proj heads, and multi-head latent attention has a shared latent projection instead (its heads "
            "split only after kv_b_proj); use dp, ep or pp",
        )
        need(
            p.cp == 1,
            f"parallel.cp {p.cp} with model_type {mc.model_type!r}: the ring attention passes keys and values as "
            "one tensor of one width, and multi-head latent attention's values are narrower (v_head_dim); use dp, "
            "ep or pp",
        )
    world = read_launch().world_size
    accum = cfg.accum_steps(cfg.data_parallel_size(world))
    check_layout(
        cfg.parallel,
        cfg.model_config(vocab_size=cfg.model.get("vocab_size", 1024)),
        world,
        max(1, accum),
        cfg.data.seq_len,
    )


def _check_attention_features(cfg: TrainConfig, need) -> None:
    """Gemma 2's soft-capped scores and gpt-oss's sinks: every attention core has them but context
    parallelism's ring attention, whose blockwise online softmax has neither."""
    if cfg.backend != "torch3d" or cfg.parallel.cp == 1:
        return
    mc = cfg.model_config(vocab_size=cfg.model.get("vocab_size", 1024))
    for has, what in ((mc.attention_sinks, "attention sinks"), (mc.attn_logit_softcapping, "soft-capped scores")):
        need(
            not has,
            f"parallel.cp {cfg.parallel.cp} with model_type {mc.model_type!r}: context parallelism's ring attention "
            f"has no {what}; use parallel.cp 1 (shard with dp, tp or pp instead)",
        )


def _check_megatron(cfg: TrainConfig, need) -> None:
    """backend megatron: megatron-core present at the pinned version, the parallel section's layout
    against the launcher's world size and the model, options megatron would reject or silently ignore."""
    m = cfg.megatron
    if cfg.backend != "megatron":
        need(m == MegatronConfig(), "the megatron section needs backend: megatron")
        return
    mc = cfg.model_config(vocab_size=cfg.model.get("vocab_size", 1024))
    need(
        mc.model_type != "deepseek_v3",
        "model_type 'deepseek_v3' with backend megatron: Baton's megatron-core GPTModel has no multi-head latent "
        "attention, DeepSeekMoE routing (sigmoid scores, correction bias, shared experts) or MTP modules; train it "
        "with backend torch, deepspeed or torch3d (dp, ep, pp)",
    )
    from baton.train.backends.megatron import check_recipe

    check_recipe(need, cfg)
