"""Baton relies on DeepSpeed internals (private methods, attributes, checkpoint keys, a C++ binding)
that DeepSpeed may move in any release; pyproject.toml pins DeepSpeed to the range they were
tested against. These tests fail loudly, naming each one that moved, when the installed DeepSpeed
is outside that range or no longer has them as Baton calls them: before a resume test fails in
some less obvious way. Widening the pin means running these (and tests/train) on the new versions.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TESTED = ">=0.19,<0.20"  # the range in pyproject.toml; 0.19.0 and 0.19.8 pass these checks
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_deepspeed_is_pinned_to_the_tested_range():
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    pins = re.findall(r'^\s*"deepspeed([^"]*)",', PYPROJECT.read_text(), flags=re.M)
    assert pins == [TESTED], f"pyproject.toml pins deepspeed{pins}, the range checked here is {TESTED}"
    installed = version("deepspeed")
    assert installed in SpecifierSet(TESTED), (
        f"DeepSpeed {installed} is installed, Baton is tested with deepspeed{TESTED}: its private APIs "
        f"(test_private_deepspeed_apis_baton_uses_are_there) may have moved; install a version in range"
    )


def accepts(fn: Callable[..., Any] | None, positional: int = 0, *keywords: str) -> str | None:
    """None if `fn` takes Baton's call: `positional` arguments (self included), then `keywords`."""
    if fn is None:
        return "is gone"
    try:
        inspect.signature(fn).bind(*[None] * positional, **dict.fromkeys(keywords))
    except TypeError as e:
        return f"no longer takes ({positional} positional, {', '.join(keywords) or 'no keywords'}): {e}"
    return None


def methods(cls: type, positional: int, *names: str) -> str | None:
    """None if each named method of `cls` takes `positional` arguments (self included)."""
    return first(*(f"{n}: {p}" if (p := accepts(getattr(cls, n, None), positional)) else None for n in names))


def assigns(cls: type, *attrs: str) -> str | None:
    """None if the class's source still sets these instance attributes (which Baton reads)."""
    src = inspect.getsource(cls)
    gone = [a for a in attrs if not re.search(rf"self\.{a}\s*(:[^=]+)?=[^=]", src)]
    return f"no longer sets {', '.join(gone)}" if gone else None


def first(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


def _cpu_adam_binding() -> str | None:
    """adam_update is a pybind11 function (no signature to inspect until built): read the C++
    function that cpu_adam.cpp binds it to, in the sources DeepSpeed ships for its JIT build."""
    import deepspeed

    csrc = Path(deepspeed.__file__).parent / "ops" / "csrc" / "adam"
    binding = re.search(r'm\.def\("adam_update",\s*&(\w+)', (csrc / "cpu_adam.cpp").read_text())
    if not binding:
        return "cpu_adam.cpp no longer binds adam_update"
    impl = re.search(rf"\bint\s+{binding[1]}\(([^)]*)\)", (csrc / "cpu_adam_impl.cpp").read_text())
    if not impl:
        return f"{binding[1]} not found in cpu_adam_impl.cpp"
    params = [p.split()[-1].lstrip("&*") for p in impl[1].split(",")]
    want = [
        "optimizer_id",
        "step",
        "lr",
        "beta1",
        "beta2",
        "epsilon",
        "weight_decay",
        "bias_correction",
        "params",
        "grads",
        "exp_avg",
        "exp_avg_sq",
    ]
    return None if params == want else f"adam_update({', '.join(params)}), Baton passes ({', '.join(want)})"


def _checkpoint_keys() -> str | None:
    """The keys of DeepSpeed's checkpoint files that zero_checkpoint.py reads back itself."""
    from deepspeed.checkpoint import constants as c

    want = {
        "OPTIMIZER_STATE_DICT": "optimizer_state_dict",
        "FP32_FLAT_GROUPS": "fp32_flat_groups",
        "SINGLE_PARTITION_OF_FP32_GROUPS": "single_partition_of_fp32_groups",
        "BASE_OPTIMIZER_STATE": "base_optimizer_state",
        "PARAM_ALIGNMENT_PADDINGS": "param_alignment_paddings",
        "ZERO_STAGE": "zero_stage",
        "PARAM_SHAPES": "param_shapes",
    }
    optional = {"PARAM_ALIGNMENT_PADDINGS"}  # newer: before it, ZeRO-1/2 did not pad each parameter (none is read)
    moved = [
        f"{k}={getattr(c, k, None)!r} (Baton reads {v!r})"
        for k, v in want.items()
        if getattr(c, k, v if k in optional else None) != v
    ]
    return "; ".join(moved) or None


def _checkpoint_file_names() -> str | None:
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine as E

    me = SimpleNamespace(_get_zero_ckpt_prefix=lambda dp, bf16_mode: E._get_zero_ckpt_prefix(None, dp, bf16_mode))
    got = Path(E._get_rank_zero_ckpt_name(me, "ckpt", "zero", 0, 1, False)).name
    return None if got == "zero_pp_rank_1_mp_rank_00_optim_states.pt" else f"a rank's optimizer file is now {got}"


def _compatible_ops() -> str | None:
    """Baton switches the shm_comm op off through this dict, before DeepSpeed's comm reads it."""
    from importlib import import_module

    ops, comm = import_module("deepspeed.ops"), import_module("deepspeed.comm.torch")  # not deepspeed.comm's `torch`
    if "__compatible_ops__" not in inspect.getsource(ops):
        return "deepspeed.ops no longer has __compatible_ops__"
    if not re.search(r"__compatible_ops__(\.get\(|\[)builder\.NAME", inspect.getsource(comm)):  # [...] in 0.19.0
        return "deepspeed.comm.torch no longer reads __compatible_ops__ by the builder's NAME"
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    return None if ShareMemCommBuilder.NAME == "deepspeed_shm_comm" else f"the op is now {ShareMemCommBuilder.NAME}"


def _op_builders() -> str | None:
    from deepspeed.accelerator import get_accelerator

    for name in ("CPUAdamBuilder", "ShareMemCommBuilder", "AsyncIOBuilder"):
        cls = get_accelerator().get_op_builder(name)
        if cls is None:
            return f"the accelerator has no {name}"
        problem = first(
            accepts(cls.load, 1, "verbose"),
            accepts(cls.is_compatible, 1, "verbose"),
            None if isinstance(getattr(cls, "NAME", None), str) else "no NAME",
        )
        if problem:
            return f"{name}: {problem}"
    return None


def _jit_load() -> str | None:
    """deepspeed_ops.py wraps jit_load and, loading a cached build, stores it where load() looks first."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if not re.search(r"if self\.name in __class__\._loaded_ops:", inspect.getsource(OpBuilder.load)):
        return "OpBuilder.load() no longer looks in _loaded_ops first"
    return first(
        accepts(OpBuilder.jit_load, 2),
        methods(OpBuilder, 1, "sources"),
        methods(OpBuilder, 2, "deepspeed_src_path"),
        None if isinstance(getattr(OpBuilder, "_loaded_ops", None), dict) else "no _loaded_ops dict",
    )


def _zero3_param_attributes() -> str | None:
    """ZeRO-3 partitioned parameters' attributes that zero_memory.py reads (and ds_shape, the whole
    shape of a zero.Init placeholder, which param_groups and init_from read)."""
    from deepspeed.runtime.zero import partition_parameters

    src = inspect.getsource(partition_parameters)
    gone = [a for a in ("ds_numel", "ds_tensor", "ds_persist", "ds_shape") if not re.search(rf"\.{a}\s*=[^=]", src)]
    return f"parameters no longer get {', '.join(gone)}" if gone else None


def _bf16_file_prefix() -> str | None:
    """ZeRO-1/2/3 under bf16 write bf16_zero_pp_rank_R_* optimizer files (zero_checkpoint globs *zero_pp_rank_*)."""
    from deepspeed.runtime.engine import DeepSpeedEngine as E

    got = E._get_zero_ckpt_prefix(None, 1, bf16_mode=True)
    return None if got == "bf16_zero_pp_rank_1" else f"a bf16 rank's optimizer files now start {got!r}"


def _unfused_optimizer() -> str | None:
    """Stage 0 under bf16/fp16: FP16_UnfusedOptimizer around the AdamW. Baton clears its inner AdamW's
    state, writes the float32 masters (fp32_groups) itself, and reads them back from its state dict."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer as U

    src = inspect.getsource(U.state_dict)
    # the inner AdamW's state is written under checkpoint.constants' OPTIMIZER_STATE_DICT (pinned above)
    wants = {"fp32_groups": r"'fp32_groups'", "optimizer_state_dict": r"(OPTIMIZER_STATE_DICT|'optimizer_state_dict')"}
    keys = [k for k, pat in wants.items() if not re.search(rf"state_dict\[{pat}\]\s*=", src)]
    return first(
        assigns(U, "fp32_groups", "optimizer"),
        f"state_dict() no longer writes {', '.join(keys)}" if keys else None,
    )


def _loss_scale_properties() -> str | None:
    """precision fp16 reads engine.optimizer.loss_scale (the scale a step's backward ran at)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    gone = [
        c.__name__
        for c in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, FP16_UnfusedOptimizer)
        if not isinstance(getattr(c, "loss_scale", None), property)
    ]
    return f"{', '.join(gone)} no longer have a loss_scale property" if gone else None


def private_api_checks() -> dict[str, tuple[str, Callable[[], str | None]]]:
    """What Baton uses -> (where, a check returning what moved or None). Imports stay inside the
    checks so one missing module is reported as such, next to the rest."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.engine import DeepSpeedEngine as Engine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Zero3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero12
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    ds = "train/backends/deepspeed.py"
    return {
        "deepspeed.initialize(model=, optimizer=, config=, dist_init_required=)": (
            ds,
            lambda: accepts(deepspeed.initialize, 0, "model", "optimizer", "config", "dist_init_required"),
        ),
        "deepspeed.init_distributed(dist_backend=)": (
            ds,
            lambda: accepts(deepspeed.init_distributed, 0, "dist_backend"),
        ),
        "DeepSpeedEngine.save_checkpoint(dir, tag=, save_latest=)": (
            ds,
            lambda: accepts(Engine.save_checkpoint, 2, "tag", "save_latest"),
        ),
        "DeepSpeedEngine.load_checkpoint(dir, tag=, load_lr_scheduler_states=)": (
            ds,
            lambda: accepts(Engine.load_checkpoint, 2, "tag", "load_lr_scheduler_states"),
        ),
        "DeepSpeedEngine.was_step_applied(), .get_global_grad_norm()": (
            ds,
            lambda: first(accepts(Engine.was_step_applied, 1), accepts(Engine.get_global_grad_norm, 1)),
        ),
        "deepspeed.ops.__compatible_ops__ (shm_comm switched off)": (ds, _compatible_ops),
        "accelerator op builders: .load(verbose=), .is_compatible(verbose=), NAME": (ds, _op_builders),
        "OpBuilder.jit_load(verbose), .sources(), .deepspeed_src_path(), _loaded_ops (looked up first)": (
            "deepspeed_ops.py",
            _jit_load,
        ),
        "ZeRO-3 swap: _swappable_optimizer_subgroup, _optimizer_states_and_gradient_swap_in/_out, "
        "_release_swap_buffers": (
            ds,
            lambda: methods(
                Zero3,
                2,
                "_swappable_optimizer_subgroup",
                "_optimizer_states_and_gradient_swap_in",
                "_optimizer_states_and_gradient_swap_out",
                "_release_swap_buffers",
            ),
        ),
        "ZeRO-3 .fp32_partitioned_groups_flat, .fp16_partitioned_groups_flat_numel, .optimizer": (
            f"{ds}, zero_memory.py",
            lambda: assigns(Zero3, "fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat_numel", "optimizer"),
        ),
        "ZeRO-1/2 ._lazy_init_hp_params_optimizer_state(), .refresh_fp32_params()": (
            ds,
            lambda: methods(Zero12, 1, "_lazy_init_hp_params_optimizer_state", "refresh_fp32_params"),
        ),
        "ZeRO-1/2 .single_partition_of_fp32_groups, .optimizer": (
            f"{ds}, zero_memory.py",
            lambda: assigns(Zero12, "single_partition_of_fp32_groups", "optimizer"),
        ),
        "ZeRO-3 parameters' ds_numel, ds_tensor, ds_persist, ds_shape": (
            "zero_memory.py, train/backends/__init__.py (param_groups), init_from",
            _zero3_param_attributes,
        ),
        "deepspeed.zero.Init(config_dict_or_path=) (init_from under ZeRO-3)": (
            f"{ds} (zero3_model)",
            lambda: accepts(deepspeed.zero.Init, 1, "config_dict_or_path"),
        ),
        "DeepSpeedCPUAdam(params, adamw_mode=, lr=, betas=, eps=), .opt_id, .ds_opt_adam": (
            ds,
            lambda: first(
                accepts(DeepSpeedCPUAdam, 1, "adamw_mode", "lr", "betas", "eps"),
                assigns(DeepSpeedCPUAdam, "opt_id", "ds_opt_adam"),
            ),
        ),
        "DeepSpeedCPUAdam's C++ adam_update(opt_id, step, lr, b1, b2, eps, wd, bias_correction, p, g, m, v)": (
            f"{ds} (_replay_cpu_adam)",
            _cpu_adam_binding,
        ),
        "deepspeed.utils.safe_set_full_fp32_param(p, value), safe_set_full_optimizer_state(p, value, key)": (
            ds,
            lambda: first(accepts(safe_set_full_fp32_param, 2), accepts(safe_set_full_optimizer_state, 3)),
        ),
        "deepspeed.zero.GatheredParameters([p], modifier_rank=)": (
            ds,
            lambda: accepts(deepspeed.zero.GatheredParameters, 1, "modifier_rank"),
        ),
        "checkpoint keys (deepspeed.checkpoint.constants)": ("train/backends/zero_checkpoint.py", _checkpoint_keys),
        "precision: FP16_UnfusedOptimizer .fp32_groups, .optimizer, state_dict()['fp32_groups', "
        "'optimizer_state_dict'] (stage 0 bf16/fp16)": (f"{ds}, train/backends/zero_checkpoint.py", _unfused_optimizer),
        "precision fp16: ZeRO-1/2, ZeRO-3 and FP16_UnfusedOptimizer .loss_scale": (ds, _loss_scale_properties),
        "precision bf16: optimizer files bf16_zero_pp_rank_R_*": (
            "train/backends/zero_checkpoint.py",
            _bf16_file_prefix,
        ),
        "checkpoint file names (zero_pp_rank_R_mp_rank_00_optim_states.pt)": (
            "train/backends/zero_checkpoint.py",
            _checkpoint_file_names,
        ),
    }


def test_private_deepspeed_apis_baton_uses_are_there():
    import deepspeed

    try:
        checks = private_api_checks()
    except (ImportError, AttributeError) as e:
        pytest.fail(f"DeepSpeed {deepspeed.__version__}: a module or name Baton imports is gone: {e!r}", pytrace=False)
    moved = []
    for api, (where, check) in checks.items():
        try:
            problem = check()
        except Exception as e:  # noqa: BLE001  (a check that cannot even run is a moved API too)
            problem = f"{type(e).__name__}: {e}"
        if problem:
            moved.append(f"  {api} [used in {where}]: {problem}")
    assert not moved, (
        f"DeepSpeed {deepspeed.__version__}: private APIs Baton relies on have moved (tested: "
        f"deepspeed{TESTED}):\n" + "\n".join(moved)
    )
