"""`baton train` on the Gated DeltaNet hybrids - Qwen3.5 (dense), Qwen3.5-MoE, Qwen3-Next - started
(`init_from`) from random-weight transformers checkpoints saved with save_pretrained, each run held to
an independent reference:

- one process per family: the step-0 loss is transformers' on the same batch (fp32), and the handoff
  after a few steps holds the trained weights and loads in transformers' own class with Baton's logits;
- one 2-rank gloo launch (every layout one after another in one process group, tests/train/
  multi_run.py): Qwen3.5-MoE at DDP (full recomputation), ZeRO-1, ZeRO-2 (selective recomputation),
  ZeRO-3, FSDP2, PP=2 (eager core, selective) and FSDP2 + EP=2, Qwen3-Next at FSDP2 (its packed
  projections sliced from the file) and dense Qwen3.5 at ZeRO-3 follow their family's one-process
  run: the same losses step by step, the same final weights, a handoff transformers loads;
- what a hybrid cannot train with is refused before any work, naming the mixer and the reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from baton.common.checkpoint import load_checkpoint, load_state_dict
from baton.common.config import ConfigError
from baton.common.tokenizer import train_char
from baton.train.backends.readers import read_any
from baton.train.recipe import config_from_dict
from baton.train.trainer import train
from safetensors.torch import load_file, save_file

from .conftest import MULTI_RUN, PATTERN_TEXT, final_state, losses, max_rel_diff, run
from .test_init_from import first_loss, hf_first_loss, recipe

STEPS = 4
VOCAB = 72  # (test_init_from's: hf_first_loss's batch is its recipe's)
# Two layers, a Gated DeltaNet then gated attention (so pp=2 puts one of each on a stage); the DeltaNet
# has 2 key heads serving 4 value heads, a conv of 4; attention 4 query heads over 2 KV heads.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    initializer_range=0.1,  # far from uniform logits, so a wrong slice shows in the loss
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
FAMILIES = {
    "qwen3_5": (transformers.Qwen3_5TextConfig, dict(intermediate_size=48)),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, MOE),
    # Qwen3-Next: packed in_proj_qkvz / in_proj_ba, a dense MLP in its attention layer
    "qwen3_next": (transformers.Qwen3NextConfig, dict(**MOE, intermediate_size=48, mlp_only_layers=[1])),
}
CLASSES = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
DS = "backend=deepspeed"
# mode -> (family, overrides): one 2-rank launch trains them all
LAYOUTS = {
    "ddp": ("qwen3_5_moe", ["recompute.mode=full"]),
    "zero1": ("qwen3_5_moe", [DS, "deepspeed.stage=1"]),
    "zero2": ("qwen3_5_moe", [DS, "deepspeed.stage=2", "recompute.mode=selective"]),
    "zero3": ("qwen3_5_moe", [DS, "deepspeed.stage=3"]),
    "fsdp2": ("qwen3_5_moe", ["backend=torch3d", "parallel.dp=2"]),
    "pp2": ("qwen3_5_moe", ["backend=torch3d", "parallel.pp=2", "attention=eager", "recompute.mode=selective"]),
    "ep2": ("qwen3_5_moe", ["backend=torch3d", "parallel.dp=2", "parallel.ep=2"]),
    "next-fsdp2": ("qwen3_next", ["backend=torch3d", "parallel.dp=2"]),
    "dense-zero3": ("qwen3_5", [DS, "deepspeed.stage=3"]),
}
# Final weights after STEPS steps: 1e-4 relative (seen: <= 2.2e-5, at ZeRO-3 and PP, where gradients are
# summed in another order; an expert few tokens chose has a gradient near rounding, which Adam's
# normalised step turns into a full-size one).
WEIGHTS_RTOL = 1e-4


def hf_model(family: str) -> torch.nn.Module:
    """A random-weight transformers model; its 1-D parameters ((1 + w) norms, the gated norm, A_log,
    dt_bias) moved off their initial values, so that reading them wrongly shows."""
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**SHAPE, **extra)).float().eval()
    assert type(model).__name__ == CLASSES[family]
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """root/corpus.txt, and root/<family>: each family's save_pretrained directory with a char tokenizer."""
    root = tmp_path_factory.mktemp("qwen3_5_train")
    (root / "corpus.txt").write_text(PATTERN_TEXT)
    tok = train_char(PATTERN_TEXT)
    for family in FAMILIES:
        hf_model(family).save_pretrained(root / family)
        tok.save(root / family)
    return root


def fine_tune(root: Path, family: str, out: Path) -> dict:
    return recipe(
        root / "corpus.txt",
        out,
        root / family,
        max_steps=STEPS,
        export=True,
        optim={"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 0},
    )


@pytest.fixture(scope="module")
def single(files) -> dict[str, dict]:
    """Each family fine-tuned by one process (here, one thread): the references. family -> recipe."""
    runs = {family: fine_tune(files, family, files / "single" / family) for family in FAMILIES}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for raw in runs.values():
            train(config_from_dict(raw))
    finally:
        torch.set_num_threads(before)
    return runs


@pytest.fixture(scope="module")
def launch(files) -> Path:
    """Every layout of LAYOUTS in one 2-rank process group; returns the runs' root."""
    out = files / "layouts"
    out.mkdir()
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(fine_tune(files, "qwen3_5_moe", out / "unused")))
    specs = [f"{mode}={','.join([f'init_from={files / family}', *o])}" for mode, (family, o) in LAYOUTS.items()]
    run(2, [str(path), str(out), *specs], out / "launch.log", timeout=600, script=str(MULTI_RUN))
    return out


def check_handoff(out_dir: Path, family: str) -> None:
    """The handoff holds the run's last checkpoint's weights, and transformers' class for the family
    loads it with Baton's logits."""
    ckpt = out_dir / "checkpoints" / f"step_{STEPS:08d}"
    backend = json.loads((ckpt / "trainer_state.json").read_text())["layout"]["backend"]
    trained = read_any(ckpt, backend, with_optimizer=False).weights
    ours = load_checkpoint(out_dir / "handoff").model.float().eval()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, trained[name]), f"handoff {name} is not the trained tensor"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir / "handoff").float().eval()
    assert type(hf).__name__ == CLASSES[family]
    tokens = torch.randint(0, 30, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    assert (got - ref).abs().max().item() < 1e-4 and ref.std() > 0.1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fine_tune_starts_at_transformers_loss_and_hands_off(files, single, family):
    raw = single[family]
    out = Path(raw["out_dir"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(files / family).float().eval()
    ours, ref = first_loss(out), hf_first_loss(raw, hf)
    assert abs(ours - ref) < 1e-5 * ref, f"{family}: step-0 loss {ours:.7f}, transformers {ref:.7f}"
    curve = losses(out)
    assert len(curve) == STEPS and curve[-1] < curve[0] - 0.3, curve  # it learns: the comparisons mean something
    start, handoff = load_state_dict(files / family), load_state_dict(out / "handoff")
    mixer = "model.layers.0.linear_attn.A_log"
    assert not torch.equal(start[mixer], handoff[mixer])  # (the mixer's decay trained too)
    check_handoff(out, family)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(LAYOUTS))
def test_layout_trains_like_one_process(single, launch, mode):
    family = LAYOUTS[mode][0]
    got, want = launch / mode, Path(single[family]["out_dir"])
    rel = [abs(a - b) / b for a, b in zip(losses(got), losses(want))]
    assert len(rel) == STEPS and max(rel) < 1e-5, f"{mode}: per-step relative loss differences {rel}"
    weights = final_state(got, STEPS).weights
    assert any(".linear_attn." in k for k in weights) and any(".self_attn." in k for k in weights)
    assert max_rel_diff(weights, final_state(want, STEPS).weights) < WEIGHTS_RTOL, mode
    check_handoff(got, family)


RAW = {
    "model": {**{k: v for k, v in SHAPE.items() if k != "initializer_range"}, "model_type": "qwen3_5_moe_text"},
    "data": {"seq_len": 32},
    "tokenizer": {"kind": "char"},
    "micro_batch_size": 4,
}
# (four layers: an early exit needs one inside the model)
RAW["model"].update(
    num_hidden_layers=4,
    layer_types=SHAPE["layer_types"] * 2,
    num_local_experts=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
)


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (["backend=megatron"], "builds megatron-core's GPTModel .* no Gated DeltaNet layers"),
        (["backend=torch3d", "parallel.tp=2"], r"in_proj_qkv stacks q, k and v .*\(dp, pp and ep work\)"),
        (["backend=torch3d", "parallel.cp=2"], "carries each head's state .* from the first token"),
        (["early_exit.exit_layers=[2]"], "no state slots"),
    ],
)
def test_what_a_deltanet_hybrid_cannot_train_with_is_refused_up_front(overrides, reason):
    with pytest.raises(ConfigError, match="model_type qwen3_5_moe_text \\(Gated DeltaNet mixer layers\\)") as e:
        config_from_dict(RAW, overrides)
    assert e.match(reason)
    config_from_dict(RAW)  # (the recipe itself is fine)


def test_fine_tune_from_a_multimodal_qwen3_5_checkpoint(files, single, tmp_path):
    """Qwen3.5's own checkpoints nest the text model (config.json's text_config; weights under
    model.language_model.*, beside model.visual.* and mtp.*): init_from reads the text model alone,
    to the step-0 loss of the plain save_pretrained directory."""
    nested = tmp_path / "nested"
    shutil.copytree(files / "qwen3_5", nested)
    text = json.loads((nested / "config.json").read_text())
    outer = transformers.Qwen3_5Config(text_config=text, tie_word_embeddings=False)
    (nested / "config.json").write_text(outer.to_json_string())
    plain = load_file(nested / "model.safetensors")
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in plain.items()}
    weights |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(32, 64)}
    save_file(weights, nested / "model.safetensors", metadata={"format": "pt"})
    raw = {**fine_tune(files, "qwen3_5", tmp_path / "run"), "init_from": str(nested), "max_steps": 1, "export": False}
    train(config_from_dict(raw))
    assert first_loss(tmp_path / "run") == first_loss(Path(single["qwen3_5"]["out_dir"]))
