"""The DeepSpeed config Baton builds from a recipe, and the checks that keep `deepspeed.extra` honest.

`deepspeed.extra` is merged on top of what Baton derives, so it could quietly change what the rest of
the recipe says, or what Baton's own code relies on: the ZeRO stage and offload devices (Baton's
step skipping, checkpoint layout and NVMe state handling follow deepspeed.stage/offload_*), the
batch arithmetic (DeepSpeed steps at its own accumulation boundary), the precision (the recipe's
`precision` picks DeepSpeed's bf16 or fp16 section, with float32 master weights and float32
gradient reductions), the optimizer and schedule (Baton hands DeepSpeed its own AdamW and sets the
lr every step) and the checkpoint format (Baton reads and writes DeepSpeed's files itself). So the
*merged* config is checked: the same guards as for Baton's own keys run on the values DeepSpeed
will really use, and a value that disagrees with the recipe is refused, naming the key. Keys that
only tune DeepSpeed (bucket sizes, prefetching, overlap, logging, the fp16 loss scaler's window and
initial power) pass through untouched.

Pure dict arithmetic, no DeepSpeed import: it runs when the recipe is read, before any process group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from baton.train.config import TrainConfig

Need = Callable[[bool, str], None]
EXTRA = "deepspeed.extra"
PRECISION_SECTIONS = ("fp16", "bf16", "bfloat16", "torch_autocast")  # "bfloat16": DeepSpeed's old name for bf16
# precision -> the section Baton enables: DeepSpeed's own mixed precision (the module in that dtype,
# float32 master weights in its optimizer, dynamic loss scaling for fp16 with DeepSpeed's defaults).
SECTION = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}
LEGACY_OFFLOAD = ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")  # old spellings of offload_*
FIXED = {
    "zero_allow_untested_optimizer": True,  # Baton's AdamW is not on DeepSpeed's list
    "zero_force_ds_cpu_optimizer": False,
}  # torch AdamW on offloaded state is allowed (slower)


def ds_config(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """What deepspeed.initialize gets: Baton's keys, with deepspeed.extra merged on top."""
    d = cfg.deepspeed
    zero: dict[str, Any] = {"stage": d.stage}
    for key, device in (("offload_optimizer", d.offload_optimizer), ("offload_param", d.offload_param)):
        if device != "none":
            zero[key] = {"device": device, **({"nvme_path": d.nvme_path} if device == "nvme" else {})}
    conf = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.accum_steps(world_size),
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        **FIXED,
        "steps_per_print": 2**31 - 1,
    }
    if SECTION[cfg.precision]:
        conf[SECTION[cfg.precision]] = {"enabled": True}
        conf["communication_data_type"] = "fp32"  # gradient reductions (DeepSpeed's default: the compute dtype)
    if cfg.precision == "fp16":
        conf["fp16"].update(fp16_scaler(cfg))
    return merge(conf, d.extra)


def fp16_scaler(cfg: TrainConfig) -> dict[str, Any]:
    """The recipe's loss_scale section in DeepSpeed's words, so both backends scale alike: dynamic
    (loss_scale 0), halved on every overflow (hysteresis 1; DeepSpeed's default 2 waits for a second)."""
    ls = cfg.loss_scale
    return {"loss_scale": 0, "initial_scale_power": ls.initial_power, "loss_scale_window": ls.window, "hysteresis": 1}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_zero(need: Need, stage: Any, opt: Any, param: Any, nvme_path: Any, names: dict[str, str]) -> None:
    """Baton's ZeRO guards, for its own keys and for the merged config alike; `names` says where
    each value came from (deepspeed.stage, or deepspeed.extra.zero_optimization.stage, ...)."""
    s, o, p = names["stage"], names["offload_optimizer"], names["offload_param"]
    need(stage in (0, 1, 2, 3) and not isinstance(stage, bool), f"{s} must be 0, 1, 2 or 3, got {stage!r}")
    for name, v in ((o, opt), (p, param)):
        need(v in ("none", "cpu", "nvme"), f"{name} must be one of ('none', 'cpu', 'nvme'), got {v!r}")
    need(opt == "none" or stage >= 1, f"{o} needs ZeRO stage >= 1 (it is {opt!r}, {s} is {stage})")
    need(
        param == "none" or stage == 3,
        f"{p} needs ZeRO stage 3: only stage 3 shards parameters (it is {param!r}, {s} is {stage})",
    )
    # Trap: DeepSpeed accepts nvme optimizer offload at stage 1/2 and silently keeps the state in CPU memory.
    need(
        opt != "nvme" or stage == 3,
        f"{o}: nvme needs ZeRO stage 3; at stage 1/2 DeepSpeed silently "
        f"offloads to CPU memory instead ({s} is {stage}). Use stage 3, or offload_optimizer: cpu",
    )
    need("nvme" not in (opt, param) or bool(nvme_path), f"nvme offload needs {names['nvme_path']} (a local folder)")


def check_ds_config(need: Need, cfg: TrainConfig, world_size: int) -> None:
    """Refuse a merged DeepSpeed config that DeepSpeed would run differently from the recipe."""
    extra = cfg.deepspeed.extra
    need(isinstance(extra, dict), f"{EXTRA} must be a mapping of DeepSpeed config keys, got {extra!r}")
    conf = ds_config(cfg, world_size)

    def key(*path: str) -> str:
        """The recipe key a merged value came from: the extra one if extra sets it."""
        node: Any = extra
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return ".".join(path)
            node = node[part]
        return f"{EXTRA}." + ".".join(path)

    for section, why in (
        ("optimizer", "Baton hands DeepSpeed its own AdamW (optim.*, deepspeed.cpu_adam)"),
        ("scheduler", "Baton sets the learning rate every step (warmup + cosine, optim.*)"),
    ):
        need(section not in extra, f"{EXTRA}.{section} is not allowed: {why}")
    need("amp" not in extra, f"{EXTRA}.amp is not allowed: set precision instead (and DeepSpeed removed Apex AMP)")
    enabled = SECTION[cfg.precision]
    for section in PRECISION_SECTIONS:
        value = conf.get(section)
        need(value is None or isinstance(value, dict), f"{key(section)} must be a mapping, got {value!r}")
        on = value.get("enabled", False) if isinstance(value, dict) else False
        need(
            on is (section == enabled),
            f"{key(section)}.enabled={on!r} disagrees with "
            f"the recipe's dtype (precision: {cfg.precision}, float32 master weights): set precision "
            "(fp32 | bf16 | fp16) instead; Baton enables DeepSpeed's matching bf16/fp16 section itself",
        )
    if cfg.precision == "fp16":
        for name, value in fp16_scaler(cfg).items():
            got = conf["fp16"].get(name)
            need(
                got == value,
                f"{key('fp16', name)}={got!r} disagrees with the recipe's dynamic loss scaler ({name}={value!r}, "
                "from loss_scale.initial_power / loss_scale.window); set the loss_scale section instead",
            )
    need(
        conf.get("communication_data_type") in (None, "fp32"),
        f"{EXTRA}.communication_data_type={conf.get('communication_data_type')!r}: gradients are reduced in "
        "float32 (the master weights' dtype) whatever the precision; drop it or set fp32",
    )
    types = conf.get("data_types")
    need(
        not isinstance(types, dict) or types.get("grad_accum_dtype") in (None, cfg.precision),
        f"{EXTRA}.data_types.grad_accum_dtype must be {cfg.precision} (the compute dtype, DeepSpeed's default) under "
        f"precision {cfg.precision}: another one makes DeepSpeed switch optimizers (BF16_Optimizer at ZeRO-1) "
        "or refuse (ZeRO-0), and Baton's checkpoint conversion follows the ZeRO optimizer",
    )
    for name, want in FIXED.items():
        need(
            conf.get(name) == want,
            f"{EXTRA}.{name}={conf.get(name)!r}: Baton sets it to {want} (its optimizer "
            "is torch's AdamW or DeepSpeedCPUAdam); drop it",
        )
    _check_batch(need, cfg, conf, world_size, key)
    need(
        conf.get("gradient_clipping") == cfg.optim.grad_clip,
        f"{key('gradient_clipping')}={conf.get('gradient_clipping')!r} disagrees with optim.grad_clip="
        f"{cfg.optim.grad_clip}; set optim.grad_clip instead",
    )
    ckpt = conf.get("checkpoint")
    for name in ("load_universal", "use_node_local_storage"):
        need(
            not (isinstance(ckpt, dict) and ckpt.get(name)),
            f"{EXTRA}.checkpoint.{name} is not allowed: Baton "
            "writes DeepSpeed's checkpoint files into one shared folder and converts other layouts itself",
        )
    _check_zero_section(need, cfg, conf["zero_optimization"], key)


def _check_batch(need: Need, cfg: TrainConfig, conf: dict[str, Any], world: int, key: Callable[..., str]) -> None:
    """DeepSpeed steps at its own accumulation boundary and scales the loss by its own count: both
    must be the recipe's. (Checked where the batch arithmetic fits the world size; where it does
    not, the recipe's own batch check says so.)"""
    m, g = cfg.micro_batch_size, cfg.global_batch_size
    got = conf.get("train_micro_batch_size_per_gpu")
    need(
        got == m,
        f"{key('train_micro_batch_size_per_gpu')}={got!r} disagrees with micro_batch_size={m}; "
        "set micro_batch_size instead",
    )
    if cfg.grad_accum_steps is None and g is not None and g % (m * world):
        return
    accum, global_batch = cfg.accum_steps(world), cfg.global_batch(world)
    got = conf.get("gradient_accumulation_steps")
    need(
        got == accum,
        f"{key('gradient_accumulation_steps')}={got!r} disagrees with the recipe's "
        f"{accum} accumulation steps (global_batch_size {global_batch} / (micro_batch_size {m} x "
        f"data-parallel size {world})); set grad_accum_steps or global_batch_size instead",
    )
    got = conf.get("train_batch_size", global_batch)
    need(
        got == global_batch,
        f"{key('train_batch_size')}={got!r} disagrees with the recipe's global batch of "
        f"{global_batch} (micro_batch_size {m} x {accum} accumulation steps x data-parallel size {world}); "
        "set global_batch_size instead",
    )


def _check_zero_section(need: Need, cfg: TrainConfig, zero: Any, key: Callable[..., str]) -> None:
    need(
        isinstance(zero, dict),
        f"{EXTRA}.zero_optimization must be a mapping (DeepSpeed reads `true` as "
        f"stage 1), got {zero!r}; set deepspeed.stage instead",
    )
    legacy = sorted(set(LEGACY_OFFLOAD) & set(zero))
    need(
        not legacy,
        f"{EXTRA}.zero_optimization.{', '.join(legacy)}: old spellings of offload_optimizer/"
        "offload_param; set deepspeed.offload_optimizer / deepspeed.offload_param instead",
    )
    d = cfg.deepspeed
    sections = {}
    for name in ("offload_optimizer", "offload_param"):
        sec = zero.get(name)
        need(sec is None or isinstance(sec, dict), f"{key('zero_optimization', name)} must be a mapping, got {sec!r}")
        sections[name] = sec or {}
    opt, param = (sections[n].get("device", "none") for n in ("offload_optimizer", "offload_param"))
    nvme_name = "offload_optimizer" if opt == "nvme" else "offload_param"
    nvme_path = sections[nvme_name].get("nvme_path")
    names = {
        "stage": key("zero_optimization", "stage"),
        "offload_optimizer": key("zero_optimization", "offload_optimizer", "device"),
        "offload_param": key("zero_optimization", "offload_param", "device"),
        "nvme_path": key("zero_optimization", nvme_name, "nvme_path"),
    }
    names = {k: v if v.startswith(EXTRA) else f"deepspeed.{k}" for k, v in names.items()}
    stage = zero.get("stage", 0)
    check_zero(need, stage, opt, param, nvme_path, names)
    recipe = {"stage": d.stage, "offload_optimizer": d.offload_optimizer, "offload_param": d.offload_param}
    for name, got in (("stage", stage), ("offload_optimizer", opt), ("offload_param", param)):
        need(
            got == recipe[name],
            f"{names[name]}={got!r} disagrees with deepspeed.{name}={recipe[name]!r}: Baton's "
            f"step skipping, checkpoint layout and resume follow deepspeed.{name}; set deepspeed.{name}: {got} "
            f"instead of overriding it in {EXTRA}",
        )
    for name in ("offload_optimizer", "offload_param"):
        path = sections[name].get("nvme_path")
        need(
            sections[name].get("device") != "nvme" or path == d.nvme_path,
            f"{EXTRA}.zero_optimization.{name}.nvme_path={path!r} disagrees with deepspeed.nvme_path="
            f"{d.nvme_path!r} (the folder Baton checks and creates); set deepspeed.nvme_path instead",
        )
