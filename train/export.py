"""Handoff: turn a training checkpoint (any backend, ZeRO-3 shards included) into the
foundation's checkpoint format, with the tokenizer, for the server and for transformers.

Consolidation reads the files (baton.train.backends.readers), not a live engine, so it runs on
one process after training (`handoff`), or later with `baton export`. `write_handoff` is the one
writer of trained weights into that format; everything that hands a model off goes through it.

The handoff keeps the run's training dtype: a bf16 (fp16) run is written in bfloat16 (float16),
rounded from its float32 master weights, and its config.json / baton.json say so, so the server
loads it in that dtype. The training checkpoint keeps the float32 masters.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from baton.common.checkpoint import HandoffMetadata, expected_shapes, read_config, save_checkpoint
from baton.common.config import ModelConfig
from baton.common.mtp import module_name
from baton.train.backends.readers import read_any
from baton.train.checkpointing import Checkpointer, find_checkpoint, read_state
from baton.train.config import PRECISIONS

log = logging.getLogger(__name__)


def write_handoff(
    out_dir: str | Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    *,
    tokenizer_dir: str | Path | None = None,
    metadata: HandoffMetadata | None = None,
) -> Path:
    """Write whole trained weights (by parameter name, as training keeps them) to `out_dir` as a
    handoff checkpoint in the config's dtype, atomically."""
    # A tied LM head is one parameter, stored once: the names the handoff expects are exactly these
    # (DeepSeek-V3's MTP module k, trained as mtp.k.*, is model.layers.{num_hidden_layers + k}.*).
    n = config.num_hidden_layers
    state_dict = {name: weights[module_name(name, n)].to(dtype) for name, (_, dtype) in expected_shapes(config).items()}
    return save_checkpoint(out_dir, config, state_dict, tokenizer_dir=tokenizer_dir, metadata=metadata)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the handoff checkpoint of `checkpoint` (a step directory, or a run's out_dir /
    checkpoints folder, whose latest step is used) to `out_dir`, atomically."""
    ckpt = find_checkpoint(checkpoint)
    state = read_state(ckpt)
    layout = state["layout"]
    precision = layout.get("precision", "fp32")  # checkpoints from before mixed precision: fp32
    config = dataclasses.replace(read_config(ckpt), torch_dtype=PRECISIONS[precision])
    weights = read_any(ckpt, layout["backend"], with_optimizer=False).weights
    parallel = {"dp": layout["world_size"], "tp": 1, "pp": 1, "cp": 1}
    if (ckpt / "parallel_layout.json").is_file():  # backend torch3d records its dp x pp x cp x tp
        parallel = {k: v for k, v in json.loads((ckpt / "parallel_layout.json").read_text()).items() if k in parallel}
    meta = HandoffMetadata(
        producer="baton train",
        step=state["step"],
        tokens_seen=state["tokens_seen"],
        parallel_layout=parallel,
        extra={
            "training": {
                "backend": layout["backend"],
                "zero_stage": layout["zero_stage"],
                "precision": precision,
                "master_weights_dtype": "float32",
                "source_checkpoint": str(ckpt.resolve()),
            }
        },
    )
    out = write_handoff(out_dir, config, weights, tokenizer_dir=ckpt / "tokenizer", metadata=meta)
    log.info("exported %s (step %d, %s) to %s", ckpt, state["step"], config.torch_dtype, out)
    return out


def handoff(checkpointer: Checkpointer) -> Path | None:
    """Rank 0, at the end of a run: the handoff checkpoint (out_dir/handoff) of its last
    checkpoint, if the recipe exports and there is one."""
    cfg = checkpointer.cfg
    if not (checkpointer.dist.is_main and cfg.export and checkpointer.last is not None):
        return None
    out = export_checkpoint(checkpointer.last, Path(cfg.out_dir) / "handoff")
    log.info("handed off the trained model to %s", out)
    return out
