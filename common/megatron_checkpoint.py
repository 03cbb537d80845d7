"""Megatron-core dist checkpoints (torch_dist, as megatron.core.dist_checkpointing.save writes them)
<-> Baton handoff checkpoints. The tensor layout is megatron_layout's; this file only does the I/O.

megatron-core is an optional dependency, imported inside the functions. The checkpoint holds only
weights (megatron's own files, plus a Baton config.json and tokenizer files so the way back needs no
flags); reading a Megatron-LM training directory takes its latest iteration and ignores the optimizer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from baton.common.checkpoint import (
    TOKENIZER_FILES,
    CheckpointError,
    HandoffMetadata,
    atomic_directory,
    load_state_dict,
    read_config,
    save_checkpoint,
)
from baton.common.config import DTYPES, ConfigError, ModelConfig
from baton.common.errors import UserError
from baton.common.hf import config_from_hf, config_to_hf
from baton.common.megatron_layout import check_layout, from_dist_layout, to_dist_layout

log = logging.getLogger(__name__)

EXTRA_STATE = tuple(
    f"decoder.layers.{m}._extra_state"
    for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
)
LATEST_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's pointer to its newest iter_NNNNNNN/


def _dist_checkpointing() -> Any:
    try:
        from megatron.core import dist_checkpointing
    except ImportError as e:
        raise UserError(
            f'Megatron checkpoints need megatron-core (pip install -e ".[megatron]"); import failed: {e}'
        ) from e
    from baton.common import megatron_compat

    megatron_compat.activate()  # without CUDA: the torch_dist writer's synchronize and cuda flags
    return dist_checkpointing


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    """dist_checkpointing needs torch.distributed: a one-rank gloo group when none exists (an
    in-memory store, so no port is taken)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise UserError("Megatron checkpoint conversion runs in one process, not inside a multi-rank job")
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def save_megatron(
    state_dict: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    tp_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a dist checkpoint that megatron-core's GPTModel loads at any TP/PP (the vocab is padded
    for `tp_size`, as Megatron pads it for a run at that TP)."""
    dc = _dist_checkpointing()
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    check_layout(cfg, tp_size)
    tensors = to_dist_layout(state_dict, cfg, tp_size, make_vocab_size_divisible_by)
    sharded: dict[str, Any] = {
        k: ShardedTensor.from_rank_offsets(k, t.contiguous(), replica_id=0) for k, t in tensors.items()
    }
    layers = cfg.num_hidden_layers
    for key in EXTRA_STATE:  # the linears' (empty) extra state, per layer, as GPTModel's sharded_state_dict asks for it
        for i in range(layers):
            sharded[f"{key}.{i}"] = ShardedObject(key, None, (layers,), (i,), replica_id=0)
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        with _one_rank_group():
            dc.save(sharded, str(tmp))
        (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if tokenizer_dir is not None and (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
    log.info("wrote megatron dist checkpoint %s (%d tensors, padded for tp=%d)", out_dir, len(tensors), tp_size)
    return out_dir


def megatron_checkpoint_dir(path: str | Path) -> Path:
    """The torch_dist directory itself, or a Megatron-LM save directory's latest iteration."""
    d = Path(path)
    if (d / LATEST_FILE).is_file():
        it = (d / LATEST_FILE).read_text().strip()
        d = d / ("release" if it == "release" else f"iter_{int(it):07d}")
    if not (d / "metadata.json").is_file():
        raise CheckpointError(f"{path} is not a megatron dist checkpoint: no metadata.json (or {LATEST_FILE})")
    return d


def load_megatron(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Baton's state dict from a dist checkpoint's model tensors (in the dtype they were saved in)."""
    dc = _dist_checkpointing()
    d = megatron_checkpoint_dir(path)
    with _one_rank_group():
        meta = dc.load_tensors_metadata(str(d))
        wanted = {k: v for k, v in meta.items() if k.split(".")[0] in ("embedding", "decoder", "output_layer")}
        if not wanted:
            raise CheckpointError(f"{d} holds no GPTModel weights (keys: {', '.join(sorted(meta)[:5])}, ...)")
        tensors = dc.load(wanted, str(d), validate_access_integrity=False)
    return from_dist_layout(tensors, cfg)


def export_megatron(
    baton_dir: str | Path, out_dir: str | Path, *, tp_size: int = 1, make_vocab_size_divisible_by: int = 128
) -> Path:
    """`baton convert --to-megatron`: a Baton (or HF) checkpoint directory -> a dist checkpoint."""
    cfg = read_config(baton_dir)
    state = load_state_dict(baton_dir)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return save_megatron(
        state,
        cfg,
        out_dir,
        tp_size=tp_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tokenizer_dir=baton_dir,
    )


def import_megatron(
    megatron_dir: str | Path, out_dir: str | Path, *, config: str | Path | None = None, dtype: str | None = None
) -> Path:
    """`baton convert --from-megatron`: a dist checkpoint -> a Baton checkpoint. The model config
    comes from `config` (a config.json or a checkpoint directory holding one), else from the
    config.json that --to-megatron wrote next to the weights."""
    d = megatron_checkpoint_dir(megatron_dir)
    source = Path(config) if config is not None else d / "config.json"
    if not source.exists():
        raise ConfigError(
            f"{megatron_dir} has no config.json: pass the model's config with --config "
            "(a config.json or a Baton/HF checkpoint directory)"
        )
    cfg = read_config(source) if source.is_dir() else config_from_hf(json.loads(source.read_text()))
    state = load_megatron(d, cfg)
    stored = {t.dtype for t in state.values()}
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        state = {k: v.to(DTYPES[dtype]) for k, v in state.items()}
        cfg.torch_dtype = dtype
    elif len(stored) == 1:
        cfg.torch_dtype = {v: k for k, v in DTYPES.items()}[stored.pop()]
    meta = HandoffMetadata(producer="baton convert --from-megatron", extra={"source": str(d.resolve())})
    tok = d if any((d / n).is_file() for n in TOKENIZER_FILES) else (source if source.is_dir() else source.parent)
    return save_checkpoint(out_dir, cfg, state, tokenizer_dir=tok, metadata=meta)
