"""Mixed precision through the real `baton train` (torchrun on loopback, gloo): bf16 loss curves of
every backend agree with each other and with fp32, the optimizer steps float32 master weights in all
of them, fp16's loss scaler skips overflowing steps and recovers, a bf16 handoff is bfloat16 and
serves the trainer's greedy tokens, and the combinations a backend cannot run are refused up front.

Tolerances. bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-9 of it, one ulp is
2^-8 relative (0.39%). The backends round in different places - autocast only rounds matmul and
attention inputs (norms, residual stream and loss stay float32), FSDP2 and DeepSpeed hold whole
bf16 layers and a bf16 residual stream - and reduce in different orders, and 20 AdamW steps carry
each difference on. Two correct bf16 runs measured here stay within ~0.1% of each other per step
(a third of an ulp), so they must agree to BF16 = one ulp of the loss; a real precision bug moves
the curve by more (DeepSpeed's stage-0 phantom AdamW step, for one, moved it by 1.1% at step 3).
Against fp32 the bound is two ulps (FP32), since every bf16 rounding is then a difference. fp16
keeps 11 bits, but the training dynamics, not the format, set how far a perturbed run drifts
(measured: 0.06% from fp32, against bf16's 0.09%), so FP16 = 2^-9, half a bf16 ulp, a quarter of
FP32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from deepspeed.accelerator import get_accelerator
from safetensors.torch import load_file

from baton.common.checkpoint import load_checkpoint, read_config, verify_hashes
from baton.common.cli import main
from baton.common.model import greedy_generate
from baton.common.tokenizer import Tokenizer
from baton.train.backends.readers import read_any

from .conftest import CKPT_STEP, STEPS, TINY, losses, run

PRECISION_RUN = str(Path(__file__).with_name("precision_run.py"))
BF16, FP32, FP16 = 2.0**-8, 2.0**-7, 2.0**-9
DS, BF = ["backend=deepspeed"], ["precision=bf16"]
T3D = [*BF, "backend=torch3d"]
OVERFLOW = ["precision=fp16", "loss_scale.initial_power=26", "loss_scale.window=4"]  # 2^26: logit grads overflow
CKPT = f"checkpoints/step_{CKPT_STEP:08d}"  # "{root}/RUN/" + CKPT: a run's step-10 checkpoint
# name -> (processes, overrides): one launch per world size, every run of it in one process group.
RUNS: dict[str, tuple[int, list[str]]] = {
    "ddp": (2, BF),
    **{f"z{s}": (2, [*BF, *DS, f"deepspeed.stage={s}"]) for s in range(4)},
    "z2-offload": (2, [*BF, *DS, "deepspeed.stage=2", "deepspeed.offload_optimizer=cpu", "deepspeed.cpu_adam=false"]),
    "z3-offload-cpuadam": (
        2,
        [*BF, *DS, "deepspeed.stage=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu"],
    ),
    "fsdp": (2, [*T3D, "parallel.dp=2"]),
    "tp": (2, [*T3D, "parallel.tp=2"]),
    "pp": (2, [*T3D, "parallel.pp=2"]),
    "ddp-fp16": (2, ["precision=fp16"]),
    "fp32": (1, []),
    "bf16": (1, BF),
    "fp16": (1, ["precision=fp16"]),
    "fp16-z2": (1, ["precision=fp16", *DS, "deepspeed.stage=2"]),
    "overflow": (1, OVERFLOW),
    "overflow-z2": (1, [*OVERFLOW, *DS, "deepspeed.stage=2"]),
    # ... resumed at step 10, where its scale had fallen to 2^19: GradScaler's state comes back with it
    "overflow-resumed": (1, [*OVERFLOW, f"checkpoint.resume={{root}}/overflow/{CKPT}"]),
    # The ZeRO-3 bf16 checkpoint (2 ranks) loaded at other layouts through the universal form: only loaded.
    **{
        f"load-z3-into-{into}": (1, [*BF, *extra, f"checkpoint.resume={{root}}/z3/{CKPT}", f"max_steps={CKPT_STEP}"])
        for into, extra in (("z0", [*DS, "deepspeed.stage=0"]), ("z2", [*DS, "deepspeed.stage=2"]), ("torch", []))
    },
}
# DeepSpeed's cpu accelerator has fp16 only on some CPUs (not on an AMD Zen 2, say): there its fp16
# runs are refused up front (a test below checks the refusal) and the fp16 checks cover the rest.
DS_FP16 = bool(get_accelerator().is_fp16_supported())
if not DS_FP16:
    del RUNS["fp16-z2"], RUNS["overflow-z2"]
BF16_BACKENDS = ["ddp", "z0", "z1", "z2", "z3", "z2-offload", "z3-offload-cpuadam", "fsdp", "tp", "pp"]


@pytest.fixture(scope="session")
def precision_runs(recipe, tmp_path_factory) -> Path:
    """Every run above: the 2-rank launch first (the loads read its ZeRO-3 checkpoint)."""
    root = tmp_path_factory.mktemp("precision")
    for nproc in (2, 1):
        specs = [
            f"{name}={','.join(over).replace('{root}', str(root))}" for name, (n, over) in RUNS.items() if n == nproc
        ]
        run(nproc, [str(recipe), str(root), *specs], root / f"world{nproc}.log", timeout=900, script=PRECISION_RUN)
    return root


def report(root: Path, name: str) -> dict:
    """The run's dtype report, merged over its ranks (a pipeline stage sees only its own layers)."""
    merged: dict = {}
    for f in sorted((root / name).glob("precision_rank*.json")):
        for key, value in json.loads(f.read_text()).items():
            merged[key] = sorted(set(merged.get(key, [])) | set(value)) if isinstance(value, list) else value
    return merged


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.slow
def test_bf16_loss_curves_of_every_backend_agree(precision_runs):
    root = precision_runs
    fp32, bf16 = losses(root / "fp32"), losses(root / "bf16")
    assert fp32[-1] < fp32[0] - 0.5  # it learns, so agreeing means something
    assert bf16 != fp32 and rel(bf16, fp32) < FP32  # bf16 really ran (differs), and stays close
    for name in BF16_BACKENDS:
        curve = losses(root / name)
        assert rel(curve, bf16) < BF16, f"{name} vs plain bf16: {rel(curve, bf16):.2e}"
        assert rel(curve, fp32) < FP32, f"{name} vs fp32: {rel(curve, fp32):.2e}"


@pytest.mark.slow
def test_bf16_computes_in_bf16_with_fp32_master_weights_and_reductions(precision_runs):
    for name in ["bf16", *BF16_BACKENDS]:
        r = report(precision_runs, name)
        assert r["compute"] == ["bfloat16"], (name, r)  # a decoder matmul's output, seen during training
        assert r["masters"] == r["moments"] == ["float32"], (name, r)  # what AdamW steps, and its state
        assert r["reduce"] == ["float32"], (name, r)
        # DeepSpeed holds the module in bf16; autocast and FSDP2 keep float32 parameters (FSDP2 casts its gathers)
        assert r["params"] == (["bfloat16"] if name.startswith("z") else ["float32"]), (name, r)
    assert report(precision_runs, "fp32")["compute"] == ["float32"]


@pytest.mark.slow
def test_a_bf16_zero3_checkpoint_loads_its_float32_masters_at_other_layouts(precision_runs):
    """Through the universal form the masters are the checkpoint's float32 weights exactly, not
    their bf16-rounded module copy (which would be up to 2^-9 relative off)."""
    for into in ("z0", "z2", "torch"):
        r = report(precision_runs, f"load-z3-into-{into}")
        assert r["loaded"] == {"dtypes": ["float32"], "max_abs_diff": 0.0}, (into, r)


@pytest.mark.slow
def test_fp16_follows_fp32_and_its_loss_scaler_skips_overflows(precision_runs):
    root = precision_runs
    fp32 = losses(root / "fp32")
    for name in ("fp16", "ddp-fp16", "fp16-z2")[: 3 if DS_FP16 else 2]:
        assert rel(losses(root / name), fp32) < FP16, name
        assert report(root, name)["masters"] == ["float32"] and report(root, name)["compute"] == ["float16"]
    # torch.amp.GradScaler, and DeepSpeed's scaler (which counts its window from the step after an
    # overflow, so it doubles one clean step later)
    for name, late in (("overflow", 0), ("overflow-z2", 1))[: 2 if DS_FP16 else 1]:
        records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
        skipped = [r["skipped"] for r in records]
        assert skipped[0] and not all(skipped) and sum(skipped) < STEPS // 2, (name, skipped)
        # The scaler's rule, replayed: halve after an overflow, double after `window` (4) clean steps.
        scale, clean, expected = 2.0**26, 0, []
        for r in records:
            expected.append(scale)
            clean = 0 if r["skipped"] else clean + 1
            grow = clean - late > 0 and (clean - late) % 4 == 0
            scale = scale / 2 if r["skipped"] else scale * 2 if grow else scale
        assert [r["loss_scale"] for r in records] == expected, name
        assert 2.0**26 > max(expected[1:]) and max(expected[-8:]) > min(expected), name  # fell, then grew back
        assert records[-1]["loss"] < records[0]["loss"] - 0.5, name  # it trains through the skips
    uninterrupted = [json.loads(line) for line in (root / "overflow" / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in (root / "overflow-resumed" / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "loss_scale", "skipped")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in uninterrupted[CKPT_STEP:]]


@pytest.mark.slow
def test_a_bf16_handoff_is_bfloat16_and_serves_the_trainers_greedy_tokens(precision_runs):
    from baton.serve.engine import EngineConfig
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams

    run_dir = precision_runs / "z3"
    handoff = run_dir / "handoff"
    verify_hashes(handoff)
    meta = json.loads((handoff / "baton.json").read_text())
    assert meta["dtype"] == "bfloat16" and meta["training"]["precision"] == "bf16"
    assert read_config(handoff).torch_dtype == "bfloat16"
    stored = load_file(handoff / "model.safetensors")
    # The float32 masters of the last checkpoint, read by DeepSpeed's own consolidation, rounded once.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    masters = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints" / f"step_{STEPS:08d}"), tag="zero")
    assert stored.keys() == masters.keys()
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, masters[n].bfloat16()) for n, t in stored.items())

    model = load_checkpoint(handoff).model.eval()  # the trainer's model, in bf16 as the handoff says
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tok = Tokenizer.from_dir(handoff)
    prompts = [tok.encode(p) for p in ("ROMEO:\nWhat light", "First Citizen:\nBefore we", "KING:\n")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(handoff, EngineConfig(num_kv_blocks=32, block_size=8)) as llm:
        assert llm.engine.model.config.torch_dtype == "bfloat16"
        served = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    offline = [greedy_generate(model, torch.tensor([p]), 8)[0].tolist() for p in prompts]
    assert served == offline


@pytest.mark.slow
def test_a_handoff_written_before_mixed_precision_reads_as_float32(precision_runs, tmp_path):
    """Checkpoints without a recorded precision are float32 runs: exported as float32."""
    ckpt = precision_runs / "fp32" / "checkpoints" / f"step_{STEPS:08d}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["layout"]["precision"] == "fp32"
    del state["layout"]["precision"]
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    (old / "trainer_state.json").write_text(json.dumps(state))
    run(1, ["export", str(old), str(tmp_path / "h")], tmp_path / "export.log")
    assert {t.dtype for t in load_file(tmp_path / "h" / "model.safetensors").values()} == {torch.float32}
    weights = read_any(ckpt, "torch", with_optimizer=False).weights
    assert all(torch.equal(t, weights[n]) for n, t in load_file(tmp_path / "h" / "model.safetensors").items())


X = "deepspeed.extra="


@pytest.mark.parametrize(
    "override, message",
    [
        (["precision=bf15"], "precision must be one of ('fp32', 'bf16', 'fp16'), got 'bf15'"),
        (["model.torch_dtype=bfloat16"], "set precision: bf16 or fp16 instead"),
        (["precision=fp16", "backend=torch3d"], "precision fp16 needs a dynamic loss scaler, and backend torch3d"),
        (["precision=fp16", *DS], "precision fp16 at deepspeed.stage 0: DeepSpeed 0.19's engine.backward"),
        (["loss_scale.window=10"], "the loss_scale section needs precision: fp16 (precision is 'fp32'"),
        (["precision=fp16", "loss_scale.initial_power=65"], "loss_scale.initial_power must be an integer in 0..64"),
        (
            [*BF, *DS, "deepspeed.stage=2", X + "{fp16: {enabled: true}}"],
            "deepspeed.extra.fp16.enabled=True disagrees with the recipe's dtype (precision: bf16",
        ),
        ([*BF, *DS, "deepspeed.stage=2", X + "{bf16: {enabled: false}}"], "deepspeed.extra.bf16.enabled=False"),
        ([*BF, *DS, "deepspeed.stage=2", X + "{bf16: true}"], "deepspeed.extra.bf16 must be a mapping"),
        (
            ["precision=fp16", *DS, "deepspeed.stage=2", X + "{fp16: {loss_scale_window: 50}}"],
            "deepspeed.extra.fp16.loss_scale_window=50 disagrees with the recipe's dynamic loss scaler",
        ),
        ([*BF, *DS, "deepspeed.stage=2", X + "{communication_data_type: bf16}"], "communication_data_type='bf16'"),
        (
            [*BF, *DS, "deepspeed.stage=2", X + "{data_types: {grad_accum_dtype: fp32}}"],
            "data_types.grad_accum_dtype must be bf16",
        ),
    ],
)
def test_a_precision_a_backend_cannot_run_is_refused_before_anything_happens(
    recipe, tmp_path, capsys, override, message
):
    out = tmp_path / "run"
    assert main(["train", "--config", str(recipe), f"out_dir={out}", *override]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("baton train: error:"), err
    assert not out.exists()


def test_deepspeed_fp16_is_refused_where_its_accelerator_has_no_fp16(recipe, tmp_path, capsys, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    out = tmp_path / "run"
    args = ["precision=fp16", *DS, "deepspeed.stage=2"]
    assert main(["train", "--config", str(recipe), f"out_dir={out}", *args]) == 2
    assert "precision fp16: DeepSpeed's cpu accelerator does not support it on this machine" in capsys.readouterr().err
    assert not out.exists()


def test_the_deepspeed_config_enables_the_recipes_precision_with_float32_reductions():
    from baton.train.deepspeed_config import ds_config
    from baton.train.recipe import config_from_dict

    conf = {
        p: ds_config(config_from_dict(TINY, [*DS, "deepspeed.stage=2", f"precision={p}"]), 1) for p in ("fp32", "bf16")
    }
    assert "bf16" not in conf["fp32"] and "fp16" not in conf["fp32"] and "communication_data_type" not in conf["fp32"]
    assert conf["bf16"]["bf16"] == {"enabled": True} and conf["bf16"]["communication_data_type"] == "fp32"
    fp16 = config_from_dict(TINY, [*DS, "deepspeed.stage=2", "precision=fp16", "loss_scale.initial_power=12"])
    assert ds_config(fp16, 1)["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 1000,
        "hysteresis": 1,
    }
