"""Fine-tuning (`init_from`) from HF checkpoints that transformers made here, and from Baton handoffs.

The yardstick is transformers itself: the trainer's step-0 loss (the first batch, before any
update) must equal transformers' loss of the same model on the same batch, in fp32, for every
family and for every backend's sharded loading (FSDP2, tensor parallel, ZeRO-3, DDP). Peak memory
per rank is measured in benchmarks/train_init_memory.py (its smoke test asserts it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from baton.common.checkpoint import load_checkpoint, load_state_dict
from baton.common.config import ConfigError
from baton.common.data import DataConfig, build_datasets, torch_loader
from baton.common.hf import import_hf
from baton.common.tokenizer import Tokenizer, train_char
from baton.train.batches import GlobalBatches
from baton.train.recipe import config_from_dict
from baton.train.trainer import train

from .conftest import MULTI_RUN, PATTERN_TEXT, final_state, run

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,  # far from uniform logits, so a wrong slice shows in the loss
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen2": (transformers.Qwen2Config, {}),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
}
SEQ, MICRO, GLOBAL = 32, 4, 8
TOL = 1e-5


def hf_checkpoint(root: Path, family: str, text: str) -> tuple[Path, torch.nn.Module]:
    """A random-weight transformers model of `family` saved with save_pretrained, plus a char
    tokenizer of `text` in the same directory (the vocabulary padded to 72 rows)."""
    out = root / family
    if (out / "config.json").is_file():
        return out, transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    tok = train_char(text)
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(vocab_size=72, **BASE, **extra)).float().eval()
    if family == "qwen2":  # HF starts biases at zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    assert tok.vocab_size <= 72
    model.save_pretrained(out)
    tok.save(out)
    return out, model


def recipe(corpus: Path, out_dir: Path, init_from: Path, **extra) -> dict:
    return {
        "init_from": str(init_from),
        "data": {"path": str(corpus), "seq_len": SEQ, "val_fraction": 0.1, "cache_dir": str(out_dir.parent / "ds")},
        "micro_batch_size": MICRO,
        "global_batch_size": GLOBAL,
        "max_steps": 1,
        "eval_interval": 0,
        "eval_batches": 1,
        "log_interval": 1,
        "export": False,
        "optim": {"warmup_steps": 0},
        "logging": {"progress": False, "mfu": False, "plot": False, "tensorboard": False},
        "out_dir": str(out_dir),
        **extra,
    }


def hf_first_loss(raw: dict, hf_model: torch.nn.Module) -> float:
    """transformers' mean next-token loss on the trainer's first global batch."""
    cfg = config_from_dict(raw)
    tok = Tokenizer.from_dir(cfg.init_from)
    train_ds, _ = build_datasets(cfg.data, tok)
    batch = GlobalBatches(train_ds, GLOBAL, cfg.seed).next()
    with torch.no_grad():
        logits = hf_model(batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()


def first_loss(out_dir: Path) -> float:
    return json.loads((out_dir / "metrics.jsonl").read_text().splitlines()[0])["loss"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(PATTERN_TEXT)
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step0_loss_equals_transformers(family, corpus, tmp_path):
    ckpt, hf_model = hf_checkpoint(tmp_path, family, PATTERN_TEXT)
    raw = recipe(corpus, tmp_path / "run", ckpt)
    train(config_from_dict(raw))
    ours, ref = first_loss(tmp_path / "run"), hf_first_loss(raw, hf_model)
    assert abs(ours - ref) < TOL, f"{family}: step-0 loss {ours:.7f}, transformers {ref:.7f}"
    assert abs(ref - math.log(72)) > 0.05, "the model is near-uniform: the comparison would prove little"


# backend mode -> (family, overrides): each sharded loader on a family whose quirks it must place
# (FSDP2: Qwen2's biases; TP: the tied, vocab-parallel embedding/head; ZeRO-3 and expert
# parallelism: Mixtral's experts; PP: a stage holding only some layers; megatron: Qwen2's biases in
# its per-group fused QKV).
# zero3-bf16 takes a near-zero step, so its saved float32 masters must still be the checkpoint's.
TINY_LR = ["optim.lr=1e-9", "optim.min_lr=1e-10"]
OFFLOAD = ["deepspeed.offload_param=cpu", "deepspeed.offload_optimizer=cpu"]  # zero.Init builds on the host
MODES = {
    "fsdp2": ("qwen2", ["backend=torch3d", "parallel.dp=2"]),
    "tp2": ("llama-tied", ["backend=torch3d", "parallel.tp=2"]),
    "tp2-no-sp": ("llama", ["backend=torch3d", "parallel.tp=2", "parallel.sequence_parallel=false"]),
    "pp2": ("llama", ["backend=torch3d", "parallel.pp=2"]),
    "ep2": ("mixtral", ["backend=torch3d", "parallel.dp=2", "parallel.ep=2"]),
    "zero3": ("mixtral", ["backend=deepspeed", "deepspeed.stage=3"]),
    "zero3-offload": ("qwen2", ["backend=deepspeed", "deepspeed.stage=3", *OFFLOAD]),
    "zero3-bf16": ("llama", ["backend=deepspeed", "deepspeed.stage=3", "precision=bf16", *TINY_LR]),
    "ddp": ("llama", []),
    # megatron-core's GPTModel, its fused QKV filled per query group from the file (megatron_layout)
    "megatron-tp2": ("qwen2", ["backend=megatron", "parallel.tp=2", "parallel.sequence_parallel=false"]),
}


def run_modes(modes: dict, nproc: int, corpus: Path, tmp_path: Path) -> dict:
    """Every mode one after another in one `nproc`-rank process group; each mode's step-0 loss
    must equal transformers' (bf16: within bf16 rounding of the logits, 2e-2). The checkpoints."""
    recipe_path = tmp_path / "recipe.yaml"
    ckpts = {f: hf_checkpoint(tmp_path / "hf", f, PATTERN_TEXT) for f in {f for f, _ in modes.values()}}
    raw = recipe(corpus, tmp_path / "unused", next(iter(ckpts.values()))[0])
    recipe_path.write_text(yaml.safe_dump(raw))
    specs = [f"{m}={','.join([f'init_from={ckpts[f][0]}', *o])}" for m, (f, o) in modes.items()]
    log = tmp_path / "runs.log"
    run(nproc, [str(recipe_path), str(tmp_path / "runs"), *specs], log, timeout=600, script=str(MULTI_RUN))
    for mode, (family, _) in modes.items():
        ref = hf_first_loss({**raw, "init_from": str(ckpts[family][0])}, ckpts[family][1])
        ours = first_loss(tmp_path / "runs" / mode)
        tol = 2e-2 if "bf16" in mode else TOL
        assert abs(ours - ref) < tol, f"{mode} ({family}): step-0 loss {ours:.7f}, transformers {ref:.7f}"
    return ckpts


@pytest.mark.slow
def test_sharded_loading_at_world_size_2(corpus, tmp_path):
    ckpts = run_modes(MODES, 2, corpus, tmp_path)
    # bf16 ZeRO-3: the module holds rounded partitions, the float32 masters must be the file's values
    # (bf16 rounding of these ~0.1-sized weights would be ~1e-4 off; the 1e-9 step moves them ~1e-9)
    masters = final_state(tmp_path / "runs" / "zero3-bf16", step=1).weights
    for name, t in load_state_dict(ckpts["llama"][0]).items():
        assert (masters[name] - t).abs().max() < 1e-6, name


@pytest.mark.slow
def test_2d_fsdp2_and_tensor_parallel_at_world_size_4(corpus, tmp_path):
    """FSDP2 over TP shards: each rank's block of a weight is a slice of a slice."""
    run_modes({"dp2-tp2": ("qwen2", ["backend=torch3d", "parallel.dp=2", "parallel.tp=2"])}, 4, corpus, tmp_path)


def test_recipe_model_section_must_agree_with_the_checkpoint(corpus, tmp_path):
    ckpt, _ = hf_checkpoint(tmp_path, "llama", PATTERN_TEXT)
    raw = recipe(corpus, tmp_path / "run", ckpt)
    config_from_dict({**raw, "model": {"hidden_size": 64}})  # repeating the checkpoint is fine
    with pytest.raises(ConfigError, match=r"model.hidden_size=128 \(checkpoint: 64\)"):
        config_from_dict({**raw, "model": {"hidden_size": 128}})
    with pytest.raises(ConfigError, match="drop model.preset"):
        config_from_dict({**raw, "model": {"preset": "nanogpt-cpu"}})
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
        config_from_dict({**raw, "init_from": str(tmp_path)})
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 64"):
        config_from_dict({**raw, "data": {**raw["data"], "seq_len": 128}})


def test_a_tokenizer_larger_than_the_embedding_is_refused(corpus, tmp_path):
    ckpt, _ = hf_checkpoint(tmp_path, "llama", PATTERN_TEXT)
    big = tmp_path / "bigtok"
    train_char(PATTERN_TEXT + "".join(chr(0x4E00 + i) for i in range(80))).save(big)
    raw = recipe(corpus, tmp_path / "run", ckpt, tokenizer={"path": str(big)})
    with pytest.raises(ConfigError, match="embedding only 72"):
        train(config_from_dict(raw))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_fine_tune_resumes_from_its_own_checkpoint(corpus, tmp_path):
    """init_from sets where a fresh run starts; a run with checkpoints in out_dir resumes them."""
    ckpt, _ = hf_checkpoint(tmp_path, "llama", PATTERN_TEXT)
    raw = recipe(corpus, tmp_path / "run", ckpt, max_steps=2)
    first = train(config_from_dict(raw))
    again = train(config_from_dict({**raw, "max_steps": 3}))
    assert (first.steps, again.steps) == (2, 3)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # step 3 followed step 2, not a new step 1


def test_multi_file_checkpoint_and_a_corrupted_handoff(corpus, tmp_path):
    """Shards + index (save_pretrained's max_shard_size) load to transformers' loss; a handoff whose
    weights no longer match its recorded sha256 is refused before any work."""
    ckpt, hf_model = hf_checkpoint(tmp_path, "qwen2", PATTERN_TEXT)
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    Tokenizer.from_dir(ckpt).save(tmp_path / "sharded")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    raw = recipe(corpus, tmp_path / "run", tmp_path / "sharded")
    train(config_from_dict(raw))
    assert abs(first_loss(tmp_path / "run") - hf_first_loss(raw, hf_model)) < TOL

    handoff = import_hf(ckpt, tmp_path / "handoff")
    data = bytearray((handoff / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (handoff / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="does not match its sha256"):
        train(config_from_dict(recipe(corpus, tmp_path / "bad", handoff)))
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def eval_ppl(model_dir: Path, raw: dict, batches: int = 8) -> float:
    """Perplexity of a handoff on the recipe's validation blocks."""
    cfg = config_from_dict(raw)
    tok = Tokenizer.from_dir(model_dir)
    _, val = build_datasets(cfg.data, tok)
    model = load_checkpoint(model_dir).model.float().eval()
    losses = []
    with torch.no_grad():
        for i, batch in enumerate(torch_loader(val, 8, seed=0, shuffle=False)):
            if i == batches:
                break
            logits = model(batch[:, :-1])
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item())
    return math.exp(sum(losses) / len(losses))


def test_recovery_fine_tune_of_a_pruned_checkpoint_lowers_its_perplexity(corpus, tmp_path):
    """Train a base model, prune half its MLP channels and a KV head group (baton prune), fine-tune
    the pruned handoff with init_from: its perplexity on held-out blocks falls."""
    from baton.serve.quantization.calibration import CalibrationConfig
    from baton.serve.quantization.prune import PruneConfig, prune_checkpoint

    common = {
        "data": {"path": str(corpus), "seq_len": SEQ, "val_fraction": 0.1, "cache_dir": str(tmp_path / "ds")},
        "tokenizer": {"kind": "char"},
        "micro_batch_size": 8,
        "eval_interval": 0,
        "eval_batches": 2,
        "log_interval": 10,
        "logging": {"progress": False, "mfu": False, "plot": False, "tensorboard": False},
    }
    model = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    base = {**common, "model": {**model, "num_key_value_heads": 2, "max_position_embeddings": 64}}
    train(
        config_from_dict(
            {**base, "max_steps": 60, "optim": {"lr": 1e-2, "warmup_steps": 5}, "out_dir": str(tmp_path / "base")}
        )
    )
    calib = CalibrationConfig(DataConfig(path=str(corpus), seq_len=SEQ, cache_dir=str(tmp_path / "ds")), num_samples=16)
    pruned = prune_checkpoint(
        tmp_path / "base" / "handoff", tmp_path / "pruned", PruneConfig(heads=0.5, channels=0.5), calib
    )
    tune = {
        **common,
        "init_from": str(pruned),
        "max_steps": 30,
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 3},
        "out_dir": str(tmp_path / "tuned"),
    }
    train(config_from_dict(tune))
    before, after = eval_ppl(pruned, tune), eval_ppl(tmp_path / "tuned" / "handoff", tune)
    assert load_checkpoint(tmp_path / "tuned" / "handoff").config.intermediate_size == 64  # still the pruned shape
    assert after < 0.95 * before, f"perplexity {before:.3f} -> {after:.3f} after recovery fine-tuning"
