"""Backend megatron (megatron-core 0.16.1 on CPU over gloo) held to Baton's own torch path.

One torchrun launch of 4 ranks (megatron_run.py) runs every layout, the resume at another
layout, the trap canaries and an end-to-end `baton train` run with its handoff; the tests here
compare its records with a single-process torch run of the same model and data (fp32):
- parity: GPTModel at TP=PP=1 loaded from a Baton checkpoint gives Baton's logits;
- equal losses over 10 steps at TP=2, TP=2+SP, PP=2, PP=2 interleaved, TP=2 x DP=2 with the
  distributed optimizer, TP=2 x PP=2 (every case uses 4 ranks: dp makes up the rest);
- a distributed-optimizer checkpoint at TP=2 x DP=2 resumed at TP=1 x PP=2 x DP=2 continues with
  the uninterrupted run's losses;
- export -> server: the handoff gives the trained megatron model's logits and greedy output;
- each upstream trap is still there (canary), and Baton's configuration avoids it.
"""

from __future__ import annotations

import json

import pytest
import torch

from baton.common.config import ConfigError, ModelConfig
from baton.common.model import DenseCausalAttention, build_model
from baton.train.backends.ddp import DDPBackend
from baton.train.backends.megatron import MegatronLayout
from baton.train.batches import micro_batches
from baton.train.distributed import Dist
from baton.train.recipe import config_from_dict

from .conftest import run
from .megatron_run import MICRO, MODEL, NEW_TOKENS, RECIPE, SAVE_AT, STEPS, batch

pytest.importorskip("megatron.core")
SCRIPT = str(__import__("pathlib").Path(__file__).with_name("megatron_run.py"))
TOL = 1e-5
LAYOUTS = ["tp2", "tp2_sp", "pp2", "pp2_vp2", "tp2_pp2", "tp2_distopt"]


@pytest.fixture(scope="module")
def results(tmp_path_factory, corpus) -> dict:
    out = tmp_path_factory.mktemp("megatron")
    run(4, [str(out), str(corpus)], out / "run.log", timeout=600, script=SCRIPT)
    return json.loads((out / "results.json").read_text())


def torch_losses(precision: str, steps: int = STEPS) -> list[float]:
    """The same model, data and optimizer in one process with Baton's plain torch backend."""
    cfg = config_from_dict({**RECIPE, "precision": precision})
    backend = DDPBackend(cfg, build_model(ModelConfig(**MODEL), seed=0), DenseCausalAttention(), Dist())
    accum = cfg.accum_steps(1)
    return [
        backend.train_step(micro_batches(batch(s), MICRO, accum, 0, 1), RECIPE["optim"]["lr"]).loss
        for s in range(steps)
    ]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return torch_losses("fp32")


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.slow
def test_parity_with_baton_logits(results):
    """TP=PP=1 GPTModel from a Baton checkpoint (megatron_layout): Baton's logits, Llama-style
    and Qwen2-style (q/k/v biases, tied embeddings)."""
    assert set(results["parity"]) == {"llama", "qwen2"}
    for name, err in results["parity"].items():
        assert err < TOL, f"{name}: logits differ by {err:.2e} (relative to the largest)"


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_match_single_process(results, reference, layout):
    assert reference[-1] < reference[0] - 0.2  # it learns, so equal curves mean something
    run_ = results[layout]
    assert len(run_["losses"]) == STEPS
    err = rel(run_["losses"], reference)
    assert err < TOL, f"{layout}: per-step losses differ by up to {err:.2e}: {run_['losses']} vs {reference}"


@pytest.mark.slow
def test_bf16_follows_torch_autocast(results):
    """precision bf16: megatron's bf16 parameters (fp32 master weights in the optimizer) against
    Baton's autocast over fp32 parameters. The first step's loss agrees to bf16 rounding; after
    that the two round different tensors (megatron's weights themselves are bf16), so the curves
    drift apart slowly (1.2% by step 10 here) while both learn. Really bf16: half the parameter
    bytes of the fp32 run."""
    bf16, ref = results["tp2_bf16"]["losses"], torch_losses("bf16", steps=3)
    assert abs(bf16[0] - ref[0]) / ref[0] < 1e-3
    assert rel(bf16[:3], ref) < 1e-2 and bf16[-1] < bf16[0] - 0.2
    params = {n: results[n]["memory"]["accelerator"]["params"] for n in ("tp2", "tp2_bf16")}
    assert params["tp2_bf16"] * 2 == params["tp2"]


@pytest.mark.slow
def test_eval_loss_through_the_interleaved_schedule(results):
    """eval_loss at PP=2 interleaved, on 3 rows (not divisible by pp: each row pp times) and 4
    (pp parts): the whole batch's mean loss, as one process computes it."""
    import torch.nn.functional as F

    model = build_model(ModelConfig(**MODEL), seed=0)
    for rows, got in zip((3, 4), results["pp2_vp2"]["eval"]):
        tokens = batch(0)[:rows]
        with torch.no_grad():
            want = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).item()
        assert abs(got - want) / want < TOL, (rows, got, want)


@pytest.mark.slow
def test_layouts_shard_the_model(results):
    """Parallelism divides the state: per-rank parameters shrink with tp and pp, and the
    distributed optimizer shards the optimizer state over dp."""
    params = {n: results[n]["memory"]["accelerator"]["params"] for n in ("tp2", "pp2", "tp2_pp2", "tp2_distopt")}
    whole = sum(p.numel() * 4 for p in build_model(ModelConfig(**MODEL), seed=0).parameters())
    assert params["tp2"] < 0.6 * whole and params["pp2"] < 0.6 * whole and params["tp2_pp2"] < 0.35 * whole
    optim = {n: results[n]["memory"]["accelerator"]["optimizer"] for n in ("tp2", "tp2_distopt")}
    assert optim["tp2_distopt"] < 0.6 * optim["tp2"]


@pytest.mark.slow
def test_resume_distributed_optimizer_at_another_layout(results, reference):
    """Saved at TP=2 x DP=2 (distributed optimizer) after step 5, resumed at TP=1 x PP=2 x DP=2:
    the remaining losses are the uninterrupted run's."""
    resumed = results["resume_pp2_distopt"]
    assert resumed["start"] == SAVE_AT
    assert rel(resumed["losses"], reference[SAVE_AT:]) < TOL
    assert resumed["resumed_steps"] == [float(SAVE_AT)]


@pytest.mark.slow
def test_trap_interleaved_batched_p2p(results, reference):
    """Interleaved PP=2 with megatron's default batch_p2p_comm=True swaps the peer's tensors
    (same peer both ways, gloo): wrong numbers, no error. Baton turns it off for vp > 1 (and the
    interleaved case matches above); the canary shows the trap is still there upstream."""
    from baton.train.backends.megatron import transformer_config

    assert results["pp2_vp2"]["batch_p2p_comm"] is False
    tcfg = transformer_config(ModelConfig(**MODEL), MegatronLayout(pp=2, vp=2), "fp32")
    assert tcfg.batch_p2p_comm is False
    assert rel(results["trap_pp2_vp2_batch_p2p"]["losses"], reference) > 1e-2


@pytest.mark.slow
def test_trap_optimizer_state_on_load(results):
    """After loading a DistributedOptimizer checkpoint megatron leaves one `step` tensor shared by
    every parameter (each AdamW step would advance it once per parameter): Baton's load gives each
    its own. A fresh optimizer cannot build its loading state dict until its states exist (Baton
    initialises them), and the default fully_sharded_model_space sharding fails at save (Baton
    writes fully_reshardable)."""
    from baton.train.backends import megatron_ckpt

    resumed = results["resume_pp2_distopt"]
    assert resumed["step_tensors"] > 1 and resumed["distinct_step_tensors"] == resumed["step_tensors"]
    traps = resumed["traps"]
    assert traps["shared_steps_without_fix"] is True
    assert traps["fresh_state_dict"] != "ok"
    assert traps["default_sharding_save"] != "ok"
    assert megatron_ckpt.SHARDING == {"distrib_optim_sharding_type": "fully_reshardable"}


@pytest.mark.slow
def test_export_serves_the_trained_model(results):
    """`baton train` with backend megatron (tp=2 x dp=2, distributed optimizer) -> handoff -> the
    server (serve.llm.LLM, offline): the trained megatron model's logits and greedy output."""
    from baton.common.checkpoint import load_checkpoint

    trained = results["trainer"]
    assert trained["steps"] == 30 and trained["losses"][-1] < trained["losses"][0] - 0.5
    loaded = load_checkpoint(trained["handoff"])
    assert loaded.metadata["parallel_layout"] == {"dp": 2, "pp": 1, "cp": 1, "tp": 2}
    model = loaded.model
    with torch.no_grad():
        logits = model(torch.tensor([trained["prompt"]]))[0]
    want = torch.tensor(trained["prompt_logits"])
    assert ((logits - want).abs().max() / want.abs().max()).item() < TOL
    from baton.serve.engine import EngineConfig
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams

    llm = LLM(trained["handoff"], EngineConfig(num_kv_blocks=64, block_size=8))
    out = llm.generate([trained["prompt"]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert out[0].outputs[0].token_ids == trained["greedy"]
    assert len(set(trained["greedy"])) > 1  # a trained model, not one repeated token


# ---------------------------------------------------------------- the recipe checks (no processes)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["megatron.tp=2"], "the megatron section needs backend: megatron"),
        (["backend=megatron", "megatron.tp=3"], "not divisible by parallel.tp"),
        (["backend=megatron", "parallel.tp=3", "parallel.sequence_parallel=false"], "not divisible by parallel.tp"),
        (["backend=megatron", "parallel.tp=2", "data.seq_len=15"], "needs data.seq_len 15 divisible by tp=2"),
        (["backend=megatron", "megatron.vp=2"], "needs parallel.pp > 1"),
        (["backend=megatron", "parallel.pp=2", "parallel.pp_stages_per_rank=2"], "pp_schedule 1f1b runs one stage"),
        (["backend=megatron", "parallel.pp=2", "parallel.pp_schedule=gpipe"], "gpipe is torch3d's"),
        (["backend=megatron", "parallel.cp=2"], "backend megatron runs no context parallelism"),
        (["backend=megatron", "parallel.tp=2", "parallel.loss_parallel=false"], "loss on vocabulary shards"),
        (["backend=megatron", "parallel.dp=3"], "parallel.dp x tp x pp = 3 x 1 x 1 = 3 != world size 1"),
        (["backend=megatron", "megatron.recompute=some"], "megatron.recompute must be one of"),
        (["backend=megatron", "recompute.mode=full"], "set megatron.recompute"),
        (["backend=megatron", "precision=fp16"], "fp32 or bf16"),
        (["backend=megatron", "model.num_local_experts=4"], "MoE"),
        (["backend=megatron", "model.attention_bias=true"], "attention_bias"),
    ],
)
def test_bad_megatron_recipes_fail_up_front(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(RECIPE, overrides)
