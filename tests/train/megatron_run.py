"""Backend megatron at several layouts, in one torchrun process group of 4 ranks (run by
tests/train/test_megatron.py): every case uses all four ranks, one after another.

Usage: megatron_run.py OUT CORPUS. Rank 0 writes OUT/results.json: per case the per-step losses
and gradient norms (the test holds them to a single-process torch run of the same data), the
parity and trap records, and the end-to-end trainer run's handoff with its greedy continuation.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from baton.common.config import ModelConfig
from baton.common.model import DenseCausalAttention, build_model
from baton.train.backends.megatron import MegatronLayout
from baton.train.batches import micro_batches
from baton.train.distributed import Dist
from baton.train.recipe import config_from_dict

MODEL = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
SEQ, GLOBAL_BATCH, MICRO, STEPS, SAVE_AT, LR = 16, 8, 2, 10, 5, 1e-2
PROMPT, NEW_TOKENS = "First Citizen:\nWe are", 12
RECIPE = {
    "model": MODEL,
    "optim": {"lr": LR, "warmup_steps": 0},
    "data": {"seq_len": SEQ},
    "micro_batch_size": MICRO,
    "global_batch_size": GLOBAL_BATCH,
    "max_steps": STEPS,
}

# name -> the parallel and megatron sections (+ what the case does besides training).
INTERLEAVED = {"pp": 2, "pp_stages_per_rank": 2, "pp_schedule": "interleaved_1f1b"}  # megatron's vp=2
CASES: dict[str, dict] = {
    "tp2": {"parallel": {"tp": 2, "sequence_parallel": False}},
    "tp2_sp": {"parallel": {"tp": 2}, "megatron": {"recompute": "selective"}},  # sp: the parallel section's default
    "pp2": {"parallel": {"pp": 2}, "megatron": {"recompute": "full"}},
    # micro-batches of 1 sample: 4 per rank, so the interleaved schedule reaches its steady state
    # (where a rank sends to the same peer in both directions at once)
    "pp2_vp2": {"parallel": INTERLEAVED, "micro": 1, "eval": True},
    "tp2_pp2": {"parallel": {"tp": 2, "pp": 2, "sequence_parallel": False}},
    # the deprecated megatron.tp, read as parallel.tp (sequence parallelism off, as it was): tp2's model
    "tp2_bf16": {"megatron": {"tp": 2}, "precision": "bf16"},
    "tp2_distopt": {
        "parallel": {"tp": 2, "sequence_parallel": False},
        "megatron": {"distributed_optimizer": True},
        "save": SAVE_AT,
    },
    "resume_pp2_distopt": {"parallel": {"pp": 2}, "megatron": {"distributed_optimizer": True}, "resume": "tp2_distopt"},
    # The upstream trap, kept as a canary: interleaved stages with batched p2p compute wrong numbers.
    "trap_pp2_vp2_batch_p2p": {"parallel": INTERLEAVED, "micro": 1, "batch_p2p_comm": True},
}


def batch(step: int) -> torch.Tensor:
    """[GLOBAL_BATCH, SEQ + 1] tokens: arithmetic progressions mod the vocabulary (learnable)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 6, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % MODEL["vocab_size"]


def step_tensors(optimizer) -> list[torch.Tensor]:
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [st["step"] for opt in inner for st in opt.state.values()]


def run_case(name: str, out: Path) -> dict:
    from baton.train.backends.megatron import MegatronBackend

    spec, rank, world = CASES[name], dist.get_rank(), dist.get_world_size()
    micro = spec.get("micro", MICRO)
    overrides = [f"{sec}.{k}={json.dumps(v)}" for sec in ("parallel", "megatron") for k, v in spec.get(sec, {}).items()]
    recipe = {**RECIPE, "backend": "megatron", "micro_batch_size": micro, "precision": spec.get("precision", "fp32")}
    cfg = config_from_dict(recipe, overrides)
    backend = MegatronBackend(cfg, build_model(ModelConfig(**MODEL), seed=0), DenseCausalAttention(), Dist(rank, world))
    if "batch_p2p_comm" in spec:
        backend.tcfg.batch_p2p_comm = spec["batch_p2p_comm"]
    rec: dict = {"batch_p2p_comm": backend.tcfg.batch_p2p_comm, "losses": [], "norms": [], "start": 0}
    if spec.get("eval"):  # validation batches of 3 and 4 rows through the schedule, before training
        rec["eval"] = [backend.eval_loss(batch(0)[:rows]) for rows in (3, 4)]
    if "resume" in spec:
        backend.load(out / spec["resume"] / f"step_{SAVE_AT}", backend.layout)
        rec["start"] = SAVE_AT
        steps = step_tensors(backend.optimizer)
        rec["step_tensors"] = len(steps)
        rec["distinct_step_tensors"] = len({id(s) for s in steps})
        rec["resumed_steps"] = sorted({float(s) for s in steps})
    dp, dp_rank = cfg.data_parallel_size(world), cfg.data_parallel_rank(rank, world)
    for step in range(rec["start"], STEPS):
        result = backend.train_step(micro_batches(batch(step), micro, cfg.accum_steps(dp), dp_rank, dp), LR)
        rec["losses"].append(result.loss)
        rec["norms"].append(result.grad_norm)
        if spec.get("save") == step + 1:
            ckpt = out / name / f"step_{step + 1}"
            ckpt.mkdir(parents=True, exist_ok=True)
            backend.save(ckpt)
    if "resume" in spec:
        rec["traps"] = trap_canaries(backend, out / spec["resume"] / f"step_{SAVE_AT}", out / "fs_model_space")
    rec["memory"] = backend.memory()
    return rec


def trap_canaries(backend, ckpt: Path, scratch: Path) -> dict:
    """What megatron-core 0.16.1 does without Baton's workarounds (each must still be so, or the
    workaround is no longer needed): a fresh optimizer cannot build its loading state dict, the
    loaded optimizer shares one `step` tensor, the default optimizer sharding fails at save."""
    from megatron.core import dist_checkpointing

    from baton.train.backends import megatron_ckpt
    from baton.train.backends.megatron import MegatronBackend

    traps: dict = {}
    fresh = MegatronBackend(
        backend.cfg, build_model(ModelConfig(**MODEL), seed=0), DenseCausalAttention(), backend.dist
    )
    try:
        fresh.optimizer.sharded_state_dict({}, is_loading=True, metadata=megatron_ckpt.SHARDING)
        traps["fresh_state_dict"] = "ok"
    except Exception as e:  # noqa: BLE001 - the canary records what upstream raises
        traps["fresh_state_dict"] = f"{type(e).__name__}: {e}"
    state = dist_checkpointing.load(
        megatron_ckpt._sharded(fresh, is_loading=True), str(ckpt / megatron_ckpt.MEGATRON_DIR)
    )
    with megatron_ckpt._steps_loaded_apart():
        fresh.optimizer.load_state_dict(state["optimizer"])
    steps = step_tensors(fresh.optimizer)
    traps["shared_steps_without_fix"] = len({id(s) for s in steps}) == 1 < len(steps)
    try:
        sd = {f"model{v}": c.module.sharded_state_dict() for v, c in enumerate(fresh.chunks)}
        sd["optimizer"] = fresh.optimizer.sharded_state_dict(sd, is_loading=False)  # the default sharding
        if dist.get_rank() == 0:
            scratch.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sd, str(scratch))
        traps["default_sharding_save"] = "ok"
    except Exception as e:  # noqa: BLE001
        traps["default_sharding_save"] = f"{type(e).__name__}: {str(e)[:200]}"
    dist.barrier()
    return traps


def parity() -> dict:
    """GPTModel at TP=PP=1 from a Baton checkpoint against Baton's own logits (fp32), for a Llama-
    style model and a Qwen2-style one (q/k/v biases, tied embeddings)."""
    from megatron.core import parallel_state as ps

    from baton.common import megatron_compat
    from baton.common.checkpoint import load_checkpoint, load_state_dict, save_model
    from baton.train.backends.megatron import build_chunks, load_baton_weights, transformer_config

    megatron_compat.activate()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    errors = {}
    tmp = Path(os.environ["MEGATRON_RUN_OUT"]) / f"parity_rank{dist.get_rank()}"
    for name, extra in {"llama": {}, "qwen2": {"qkv_bias": True, "tie_word_embeddings": True}}.items():
        mc = ModelConfig(**MODEL, **extra)
        model = build_model(mc, seed=1)
        with torch.no_grad():  # biases are zero at init: give them values, so they count
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.1)
        save_model(tmp / name, model)
        weights = load_state_dict(tmp / name)  # the checkpoint's tensors (a tied head is stored once)
        ref = load_checkpoint(tmp / name).model
        m = MegatronLayout()
        (chunk,) = build_chunks(mc, transformer_config(mc, m, "fp32"), m)
        load_baton_weights([chunk], weights, mc, m)
        tokens = batch(0)[:2, :SEQ]
        positions = torch.arange(SEQ).expand_as(tokens)
        with torch.no_grad():
            theirs = chunk(tokens, positions, None).float()
            ours = ref(tokens).float()
        errors[name] = ((theirs - ours).abs().max() / ours.abs().max()).item()
    ps.destroy_model_parallel()
    return errors


def trainer_run(out: Path, corpus: Path) -> dict:
    """`baton train` with backend megatron (tp=2 x dp=2, distributed optimizer) on text, with its
    handoff; the trained model's greedy continuation of a prompt, for the server to reproduce."""
    from megatron.core import tensor_parallel

    from baton.common.tokenizer import Tokenizer
    from baton.train.trainer import Trainer

    raw = {
        "model": {**MODEL, "vocab_size": 128},
        "data": {"path": str(corpus), "seq_len": 32, "val_fraction": 0.05, "cache_dir": str(out / "datasets")},
        "tokenizer": {"kind": "char"},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "backend": "megatron",
        "parallel": {"tp": 2, "sequence_parallel": False},
        "megatron": {"distributed_optimizer": True},
        "micro_batch_size": 4,
        "global_batch_size": 8,
        "max_steps": 30,
        "eval_interval": 15,
        "eval_batches": 1,
        "log_interval": 1,
        "logging": {"progress": False, "mfu": False, "plot": False, "tensorboard": False},
        "out_dir": str(out / "trainer"),
    }
    trainer = Trainer(config_from_dict(raw))
    result = trainer.fit()
    chunk = trainer.backend.chunks[0].module
    chunk.eval()
    prompt = Tokenizer.from_dir(out / "trainer" / "tokenizer").encode(PROMPT)
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        for i in range(NEW_TOKENS):
            logits = chunk(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            if i == 0:
                prompt_logits = logits[0].tolist()
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    return {
        "handoff": str(result.handoff_dir) if result.handoff_dir else None,
        "steps": result.steps,
        "losses": [json.loads(line)["loss"] for line in (out / "trainer" / "metrics.jsonl").read_text().splitlines()],
        "prompt": prompt,
        "prompt_logits": prompt_logits,
        "greedy": tokens[0, len(prompt) :].tolist(),
    }


def main(out: Path, corpus: Path) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["MEGATRON_RUN_OUT"] = str(out)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))  # a hang fails, not stalls
    results: dict = {}
    try:
        results["parity"] = parity()
        for name in CASES:
            results[name] = run_case(name, out)
            gc.collect()
            dist.barrier()
        results["trainer"] = trainer_run(out, corpus)
        if dist.get_rank() == 0:
            (out / "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
