"""compile: true - every decoder layer's forward compiled (inductor) gives the eager numbers, with
one graph for all layers and unchanged parameter names, under each recomputation mode, through the
plain backend's training loop, and under FSDP2 (fp32 and bf16), pipelining, context parallelism
and tensor parallelism; the combinations it cannot run are refused up front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
import yaml
from torch.testing import assert_close

from baton.common.config import ConfigError, ModelConfig
from baton.common.model import build_model
from baton.train import compile as compile_mod
from baton.train.backends import lm_loss
from baton.train.compile import compile_layers
from baton.train.config import RecomputeConfig
from baton.train.recipe import config_from_dict
from baton.train.recompute import apply_recompute

from .conftest import TINY, run, train_args
from .parallel.conftest import torchrun

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
BATCH = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))


def losses_and_grads(mode: str, backend: str | None, steps: int = 2):
    """`steps` forward+backward passes; the last loss, its gradients, the parameter names."""
    model = build_model(CFG, seed=0)
    attn = apply_recompute(model, RecomputeConfig(mode))
    if backend is not None:
        assert compile_layers(model, backend) == CFG.num_hidden_layers
    for _ in range(steps):  # the second pass runs the cached graphs
        model.zero_grad()
        loss = lm_loss(model(BATCH[:, :-1], attn=attn), BATCH)
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, list(model.state_dict())


@pytest.mark.parametrize(
    "mode,backend",
    [("full", "inductor"), ("none", "aot_eager"), ("selective", "aot_eager")],
)
def test_compiled_layers_equal_eager_with_one_graph_for_every_layer(mode, backend):
    torch._dynamo.reset()
    want_loss, want_grads, want_names = losses_and_grads(mode, None)
    torch._dynamo.utils.counters.clear()
    loss, grads, names = losses_and_grads(mode, backend)
    # 4 identical layers, one graph: parameters are graph inputs, so depth does not add compile time.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    assert names == want_names  # no _orig_mod. prefix: checkpoints read the same
    # inductor fuses and reorders float32 reductions: equal to rounding, not bitwise
    assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for n in want_grads:
        assert_close(grads[n], want_grads[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.slow
def test_training_loop_with_compile_follows_the_eager_run(recipe, tmp_path):
    """The plain backend through Trainer: the same losses step by step as the eager run."""
    from baton.train.trainer import train

    raw = yaml.safe_load(recipe.read_text())
    losses = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, flag in (("eager", "false"), ("compiled", "true")):
            overrides = [f"out_dir={tmp_path / name}", "max_steps=6", "export=false", f"compile={flag}"]
            train(config_from_dict(raw, overrides))
            records = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            losses[name] = torch.tensor([json.loads(r)["loss"] for r in records])
    finally:
        torch.set_num_threads(threads)
    assert len(losses["eager"]) == 6
    assert_close(losses["compiled"], losses["eager"], rtol=1e-4, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,overrides",
    [(2, []), (1, ["backend=deepspeed", "deepspeed.stage=2"])],
    ids=["ddp-2", "zero2-1"],
)
def test_baton_train_with_compile_under_ddp_and_deepspeed_follows_eager(recipe, tmp_path, nproc, overrides):
    """`baton train` itself (torchrun for DDP): layers compiled before DDP / DeepSpeed wrap the model."""
    losses = {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        out = tmp_path / name
        args = train_args(recipe, out, [*overrides, "max_steps=4", "export=false", f"compile={flag}"])
        run(nproc, args, tmp_path / f"{name}.log", timeout=600)
        losses[name] = torch.tensor([json.loads(r)["loss"] for r in (out / "metrics.jsonl").read_text().splitlines()])
    assert len(losses["eager"]) == 4
    assert_close(losses["compiled"], losses["eager"], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_compiled_layers_under_fsdp2_pipeline_context_and_tensor_parallelism(tmp_path):
    """2 gloo ranks (tests/train/compile_run.py): compiled == eager, losses and gradient norms. The
    gradient norm includes the vocab-parallel embedding's, which a compiled tensor-parallel layer 0
    used to cut off (norm 0.761 instead of 0.952: train/compile.py)."""
    torchrun(2, [str(Path(__file__).with_name("compile_run.py")), str(tmp_path)], tmp_path / "log.txt")
    for case in ("fsdp2_full", "pp2", "cp2_selective", "fsdp2_bf16", "tp2_sp_full", "tp2_selective"):
        rec = torch.load(tmp_path / f"{case}.rank0.pt")
        eager, compiled = rec[None], rec["inductor"]
        assert compiled["names"] == eager["names"]
        if case == "fsdp2_bf16":
            # Fused kernels keep bf16 intermediates in fp32 where eager rounds each op: the runs differ by
            # rounding, held to one bf16 ulp of the loss (2^-8 relative), as the precision tests hold bf16.
            assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=2**-8, atol=0)
            continue
        assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=0)
        assert_close(torch.tensor(compiled["norms"]), torch.tensor(eager["norms"]), rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["backend=deepspeed", "deepspeed.stage=3"], "deepspeed.stage 3"),
        (["compile=1"], "true or false"),
    ],
)
def test_combinations_compile_cannot_run_are_refused(overrides, words, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=words):
        config_from_dict(TINY, ["compile=true", *overrides])


def test_compile_without_a_cpu_compiler_is_refused(monkeypatch):
    monkeypatch.setattr(compile_mod, "cpu_compiler", lambda: None)
    with pytest.raises(ConfigError, match="C\\+\\+ compiler"):
        config_from_dict(TINY, ["compile=true"])
