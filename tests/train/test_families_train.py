"""The 2025-26 families trained from their transformers checkpoints, on every backend that can.

Each family's random-weight model is written by transformers itself (tests/serve/test_families.py's
configs: GQA, mixed sliding and full layers, soft-capping, sinks, dense and MoE layers), its norms,
biases and sinks moved off their initial values. A run fine-tunes it with `init_from`: its step-0
loss must equal transformers' on the same batch (fp32, within 1e-5), it trains a few steps, and its
handoff must load in transformers unchanged with the logits of Baton's trained model. The plain
torch backend runs every family (each with a recomputation mode or attention core the family makes
interesting); DDP, FSDP2, ZeRO-2/3, pipeline, context and expert parallelism and megatron-core run
in one 2-rank launch over several families. Megatron refuses what its GPTModel cannot express, by
family; `baton convert` goes both ways.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from baton.common.checkpoint import load_checkpoint, load_state_dict, read_config
from baton.common.cli import main as baton
from baton.common.config import ConfigError
from baton.common.megatron_layout import baton_to_megatron, from_dist_layout, megatron_to_baton, to_dist_layout
from baton.common.tokenizer import train_char
from baton.train.backends.base import lm_loss
from baton.train.backends.readers import read_any
from baton.train.config import RecomputeConfig
from baton.train.pretrained import PretrainedWeights
from baton.train.recipe import config_from_dict
from baton.train.recompute import apply_recompute
from baton.train.trainer import train

from ..serve.test_families import BASE as SERVE_BASE
from ..serve.test_families import FAMILIES as SERVE_FAMILIES
from .conftest import MULTI_RUN, PATTERN_TEXT, losses, run
from .test_init_from import TOL, first_loss, hf_first_loss, recipe

FAMILIES = ("gemma2", "gemma3_text", "gpt_oss", "olmo2", "qwen3", "qwen3_moe")
# name -> (family, config overrides): Gemma ties its embeddings, which pipeline stages cannot split
VARIANTS = {f: (f, {}) for f in FAMILIES} | {"gemma3_text-untied": ("gemma3_text", {"tie_word_embeddings": False})}
STEPS = 3
TRAIN = dict(max_steps=STEPS, export=True, optim={"warmup_steps": 0, "lr": 1e-2})


def family_checkpoint(root: Path, name: str) -> tuple[Path, torch.nn.Module]:
    """VARIANTS[name] written by transformers (save_pretrained) with a char tokenizer of the corpus
    (vocabulary 72, even for megatron's tp=2); every 1-D weight moved, as test_families does."""
    out = root / name
    if (out / "config.json").is_file():
        return out, transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    family, overrides = VARIANTS[name]
    cls, extra = SERVE_FAMILIES[family]
    config = cls(**{**SERVE_BASE, **extra, "vocab_size": 72, "max_position_embeddings": 64, **overrides})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(out)
    tok = train_char(PATTERN_TEXT)
    assert tok.vocab_size <= 72
    tok.save(out)
    return out, hf


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(PATTERN_TEXT)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


def check_handoff(out_dir: Path, source: Path) -> None:
    """The handoff holds the run's trained float32 weights, moved away from the checkpoint it started
    from, and transformers loads it unchanged, as the family's own class, with Baton's logits."""
    handoff, ckpt = out_dir / "handoff", out_dir / "checkpoints" / f"step_{STEPS:08d}"
    backend = json.loads((ckpt / "trainer_state.json").read_text())["layout"]["backend"]
    trained, start = read_any(ckpt, backend, with_optimizer=False).weights, load_state_dict(source)
    saved = load_state_dict(handoff)
    for name, t in saved.items():
        assert torch.equal(t, trained[name]), f"handoff {name} is not the trained weight"
    moved = max((saved[n] - start[n]).abs().max().item() for n in saved)
    assert moved > 1e-3, "training left the weights where they started"
    hf = transformers.AutoModelForCausalLM.from_pretrained(handoff).float().eval()
    assert type(hf).__name__ == json.loads((source / "config.json").read_text())["architectures"][0]
    ours = load_checkpoint(handoff).model.float().eval()
    tokens = torch.randint(0, 72, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    assert (got - ref).abs().max().item() < 1e-4, f"{out_dir.name}: transformers' logits of the handoff differ"
    assert ref.std() > 0.1


# family -> overrides for its plain-torch run: recomputation where the family adds something to
# recompute (GeGLU, q/k norms, sandwich norms, the clamped SwiGLU, Qwen3-MoE's experts), the eager
# core computing Gemma 2's soft-capped scores, the Triton FlashAttention kernels gpt-oss's sinks
# (and their gradient; under TRITON_INTERPRET here)
TORCH = {
    "gemma2": ["attention=eager", "recompute.mode=selective"],
    "gemma3_text": ["recompute.mode=selective"],
    "gpt_oss": ["attention=triton", "recompute.mode=selective"],
    "olmo2": ["recompute.mode=full"],
    "qwen3": ["recompute.mode=selective"],
    "qwen3_moe": ["recompute.mode=selective"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_fine_tune_on_torch_then_transformers_loads_the_handoff(family, corpus, checkpoints, tmp_path):
    ckpt, hf = family_checkpoint(checkpoints, family)
    raw = recipe(corpus, tmp_path / "run", ckpt, **TRAIN)
    train(config_from_dict(raw, TORCH[family]))
    ours, ref = first_loss(tmp_path / "run"), hf_first_loss(raw, hf)
    assert abs(ours - ref) < TOL, f"{family}: step-0 loss {ours:.7f}, transformers {ref:.7f}"
    check_handoff(tmp_path / "run", ckpt)
    if family in ("gpt_oss", "qwen3_moe"):  # the router losses join every family's MoE layers
        records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert all(r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 for r in records), records


@pytest.mark.parametrize("family", FAMILIES)
def test_recomputation_changes_no_gradient(family, checkpoints):
    """Each recomputation mode, with the fused and the eager core, gives the gradients of none."""
    ckpt, _ = family_checkpoint(checkpoints, family)
    weights = PretrainedWeights(ckpt, read_config(ckpt))
    batch = torch.randint(0, 72, (2, 17), generator=torch.Generator().manual_seed(0))
    for attention in ("sdpa", "eager"):
        grads = {}
        for mode in ("none", "selective", "full"):
            model = weights.full_model()
            attn = apply_recompute(model, RecomputeConfig(mode), attention)
            lm_loss(model(batch[:, :-1], attn=attn), batch).backward()
            grads[mode] = {n: p.grad for n, p in model.named_parameters()}
        for mode in ("selective", "full"):
            for n, g in grads["none"].items():
                assert torch.equal(g, grads[mode][n]), f"{family} {attention} {mode}: {n}"


# mode -> (variant, overrides), all in one 2-rank launch: the sharded loaders and steps on the
# families' new parameters (sinks, q/k and sandwich norms, stacked and per-expert MoE weights, two ropes)
MODES = {
    "ddp": ("qwen3", []),
    "fsdp2": ("gpt_oss", ["backend=torch3d", "parallel.dp=2", "attention=eager"]),
    "pp2": ("gemma3_text-untied", ["backend=torch3d", "parallel.pp=2"]),
    "cp2": ("olmo2", ["backend=torch3d", "parallel.cp=2"]),
    "ep2": ("qwen3_moe", ["backend=torch3d", "parallel.dp=2", "parallel.ep=2"]),
    "zero2": ("gemma2", ["backend=deepspeed", "deepspeed.stage=2"]),
    "zero3": ("qwen3_moe", ["backend=deepspeed", "deepspeed.stage=3"]),
    # megatron-core's GPTModel with qk_layernorm (Qwen3's per-head q/k norms), fused QKV per group
    "megatron-tp2": ("qwen3", ["backend=megatron", "parallel.tp=2", "parallel.sequence_parallel=false"]),
}


@pytest.mark.slow
def test_every_backend_fine_tunes_the_families_at_world_size_2(corpus, checkpoints, tmp_path):
    modes = dict(MODES)
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        modes.pop("megatron-tp2")
    ckpts = {v: family_checkpoint(checkpoints, v) for v in {v for v, _ in modes.values()}}
    raw = recipe(corpus, tmp_path / "unused", next(iter(ckpts.values()))[0], **TRAIN)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    specs = [f"{m}={','.join([f'init_from={ckpts[v][0]}', *o])}" for m, (v, o) in modes.items()]
    run(2, [str(tmp_path / "recipe.yaml"), str(tmp_path / "runs"), *specs], tmp_path / "runs.log", 600, str(MULTI_RUN))
    reference: dict[str, list[float]] = {}  # each variant's losses on the plain torch backend, one process
    for mode, (variant, _) in modes.items():
        ckpt, hf = ckpts[variant]
        ref, ours = hf_first_loss({**raw, "init_from": str(ckpt)}, hf), first_loss(tmp_path / "runs" / mode)
        assert abs(ours - ref) < TOL, f"{mode} ({variant}): step-0 loss {ours:.7f}, transformers {ref:.7f}"
        check_handoff(tmp_path / "runs" / mode, ckpt)
        if variant not in reference:
            train(config_from_dict({**raw, "init_from": str(ckpt), "out_dir": str(tmp_path / "torch" / variant)}))
            reference[variant] = losses(tmp_path / "torch" / variant)
        # every step, not only the first: gradients (q/k norms, sinks, experts) reduced as one process has them
        got = losses(tmp_path / "runs" / mode)
        assert max(abs(a - b) for a, b in zip(got, reference[variant])) < 1e-4, (mode, got, reference[variant])


@pytest.mark.parametrize(
    "family, missing",
    [
        ("gemma3_text", "sandwich norms"),
        ("gemma2", "soft-capped attention scores"),
        ("olmo2", "post-norm layers"),
        ("gpt_oss", "attention sinks"),
    ],
)
def test_megatron_refuses_what_gptmodel_cannot_express(family, missing, corpus, checkpoints, tmp_path):
    pytest.importorskip("megatron.core")
    ckpt, _ = family_checkpoint(checkpoints, family)
    with pytest.raises(ConfigError, match=f"model_type '{family}': megatron-core's GPTModel has no .*{missing}"):
        config_from_dict(recipe(corpus, tmp_path / "run", ckpt), ["backend=megatron"])


def test_qwen3_in_megatron_layout_round_trips_bit_exact(checkpoints):
    """Qwen3's q/k norms become GPTModel's q_layernorm/k_layernorm, whole on every TP rank, and come back."""
    ckpt, _ = family_checkpoint(checkpoints, "qwen3")
    cfg, state = read_config(ckpt), load_state_dict(ckpt)
    shards = {(t, p): baton_to_megatron(state, cfg, 2, t, 2, p, 1) for t in (0, 1) for p in (0, 1)}  # tp x pp
    layer = shards[(1, 1)]["decoder.layers.0.self_attention.q_layernorm.weight"]  # global layer 1 on pp rank 1
    assert torch.equal(layer, state["model.layers.1.self_attn.q_norm.weight"])
    for back in (megatron_to_baton(shards, cfg), from_dist_layout(to_dist_layout(state, cfg, tp_size=2), cfg)):
        assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_context_parallelism_refuses_sinks(corpus, checkpoints, tmp_path):
    """(gpt-oss without sliding layers: the ring attention would drop its sinks)"""
    ckpt, _ = family_checkpoint(checkpoints, "gpt_oss")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(sliding_window=None, layer_types=["full_attention"] * config["num_hidden_layers"])
    full = tmp_path / "full"
    full.mkdir()
    for f in ckpt.iterdir():
        (full / f.name).write_bytes(f.read_bytes())
    (full / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="ring attention has no attention sinks"):
        config_from_dict(recipe(corpus, tmp_path / "run", full), ["backend=torch3d", "parallel.cp=2"])


def test_convert_both_ways_around_a_fine_tune(corpus, checkpoints, tmp_path):
    """`baton convert --from-hf` a Gemma 3 checkpoint, fine-tune the Baton copy, `--to-hf` the handoff:
    transformers loads it with the trained logits; the converted copy's tensors are the file's."""
    ckpt, _ = family_checkpoint(checkpoints, "gemma3_text")
    assert baton(["convert", "--from-hf", str(ckpt), str(tmp_path / "baton")]) == 0
    original, converted = load_state_dict(ckpt), load_state_dict(tmp_path / "baton")
    assert original.keys() == converted.keys() and all(torch.equal(original[k], converted[k]) for k in original)
    train(config_from_dict(recipe(corpus, tmp_path / "run", tmp_path / "baton", max_steps=2, export=True)))
    handoff = tmp_path / "run" / "handoff"
    assert baton(["convert", "--to-hf", str(handoff), str(tmp_path / "hf")]) == 0
    assert not (tmp_path / "hf" / "baton.json").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    tokens = torch.randint(0, 72, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = (hf(tokens).logits - load_checkpoint(handoff).model.float()(tokens)).abs().max().item()
    assert type(hf).__name__ == "Gemma3ForCausalLM" and err < 1e-4
