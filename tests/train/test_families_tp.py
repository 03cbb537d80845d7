"""Tensor-parallel training (tp=2, with and without sequence parallelism) of the 2025-26 families
equals one process: the same loss, gradients and global gradient norm after one step (fp32, 1e-5).

The pieces it reaches (families_tp_run.py): Qwen3's per-head q/k norms (their weight's gradient
sums over both ranks' heads), OLMo 2's q/k norms over the whole projection (a rank's slice of the
weight, the mean of squares over the full width) and its post-norms, Gemma's sandwich norms with
the offset, soft-capping and per-layer-type rope, gpt-oss's sinks (split by head) and its stacked
experts with biases, Qwen3-MoE's experts and a dense layer among them (the experts replicated over
tp). Layouts that cannot work are refused by check_layout with the reason.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from baton.common.config import ConfigError, ModelConfig
from baton.train.parallel.layout import ParallelConfig, check_layout

from .conftest import run
from .families_tp_run import BASE, FAMILIES, batch, model

SCRIPT = Path(__file__).with_name("families_tp_run.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("families-tp")
    run(2, [str(out)], out / "world2.log", timeout=600, script=str(SCRIPT))
    return out


def _reference(family: str) -> dict:
    m = model(family)
    tokens = batch()
    loss = F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads.values()))
    return {"loss": loss.item(), "grads": grads, "norm": norm}


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item(), k) for k in b)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_step_equals_one_process(launched, family):
    want = _reference(family)
    for sp in ("nosp", "sp"):
        got = torch.load(launched / f"{family}-{sp}.pt", weights_only=True)
        assert abs(got["loss"] - want["loss"]) / want["loss"] < TOL, (sp, got["loss"], want["loss"])
        err, name = _max_rel(got["grads"], want["grads"])
        assert err < TOL, f"{family} ({sp}): {name}'s gradient differs by {err:.2e}"
        assert abs(got["norm"] - want["norm"]) / want["norm"] < TOL, (sp, got["norm"], want["norm"])


def test_layouts_the_families_cannot_run_are_refused():
    gpt_oss = ModelConfig(**BASE, **FAMILIES["gpt_oss"])
    with pytest.raises(ConfigError, match="ep > 1 with gpt-oss: its experts are stacked tensors"):
        check_layout(ParallelConfig(ep=2), gpt_oss, 2, 2, 16)
    for family in ("gpt_oss", "gemma2"):
        with pytest.raises(ConfigError, match="ring attention. has no attention sinks .gpt-oss. or soft-capped"):
            check_layout(
                ParallelConfig(cp=2),
                ModelConfig(**BASE, **{**FAMILIES[family], "sliding_window": None, "layer_types": None}),
                2,
                2,
                16,
            )
    # Qwen3-MoE's dense layers are split like any MLP: their width must divide.
    qwen3_moe = ModelConfig(**{**BASE, "intermediate_size": 63}, **FAMILIES["qwen3_moe"])
    with pytest.raises(ConfigError, match="intermediate_size 63 is not divisible by tp=2"):
        check_layout(ParallelConfig(tp=2), qwen3_moe, 2, 2, 16)
    all_moe = ModelConfig(**{**BASE, "intermediate_size": 63}, **{**FAMILIES["qwen3_moe"], "mlp_only_layers": None})
    assert check_layout(ParallelConfig(tp=2), all_moe, 2, 2, 16).tp == 2  # experts are not split
