"""The universal training state: every tensor whole and named, independent of any layout.

fp32 weights plus AdamW's exp_avg / exp_avg_sq per parameter name, and the optimizer step. The
plain-PyTorch backend saves exactly this (safetensors, no pickles); a DeepSpeed checkpoint is
converted into it (baton.train.backends.zero_checkpoint) whenever it has to be resumed at another
world size, ZeRO stage, offload setting or backend, or exported; baton.train.backends.readers
reads any backend's checkpoint as this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class UniversalState:
    weights: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int  # optimizer steps taken (Adam's bias correction)

    def moments(self, key: str) -> dict[str, torch.Tensor]:
        return getattr(self, key)


def write_universal(directory: Path, state: UniversalState) -> None:
    save_file(
        {k: v.contiguous() for k, v in state.weights.items()}, directory / WEIGHTS_FILE, metadata={"format": "pt"}
    )
    moments = {f"{key}/{name}": t.contiguous() for key in MOMENTS for name, t in state.moments(key).items()}
    save_file(moments, directory / OPTIMIZER_FILE, metadata={"format": "pt"})
    (directory / OPTIMIZER_META).write_text(json.dumps({"step": state.step}) + "\n")


def read_universal(directory: Path, with_optimizer: bool = True) -> UniversalState:
    weights = load_file(directory / WEIGHTS_FILE)
    if not with_optimizer:
        return UniversalState(weights, {}, {}, 0)
    flat = load_file(directory / OPTIMIZER_FILE)
    moments = {key: {n.split("/", 1)[1]: t for n, t in flat.items() if n.startswith(key + "/")} for key in MOMENTS}
    step = json.loads((directory / OPTIMIZER_META).read_text())["step"]
    return UniversalState(weights, moments["exp_avg"], moments["exp_avg_sq"], step)
