"""Fine-tuning (`init_from: PATH`): start a run from an HF checkpoint directory or a Baton handoff.

The model config is the checkpoint's (a recipe's model section may only repeat it), in float32:
those are the optimizer's master weights whatever dtype the files hold, and `precision` decides
what the steps compute in (baton.train.model_section reads it). Optimizer and data start fresh
(step 0, new AdamW state).

No rank ever holds the whole model where the backend shards it:
- torch3d (FSDP2 / tensor / pipeline parallel): the model is built on the meta device, cut and
  sharded as usual, then `materialize` allocates each rank's local shards (to_empty on the rank's
  device) and fills every DTensor shard with just its slice of the file (safetensors get_slice, at
  the offset torch computes from the placements: FSDP2's Shard(0), TP column/row-wise, the vocab-
  parallel embedding and head); parameters that are not DTensors are read whole.
- DeepSpeed ZeRO-3: built under deepspeed.zero.Init (each module partitioned as it is made), then
  filled one parameter at a time (baton.train.backends.deepspeed.zero3_model).
- plain PyTorch / DDP and ZeRO-0/1/2 hold the whole model on every rank anyway: it is loaded whole,
  tensor by tensor, into a meta-built model (no random initialisation first).
RoPE's inverse frequencies are a plain float32 CPU attribute computed in the constructor, so meta
construction leaves them right. The only buffers, DeepSeek-V3's score-correction biases, are read like
parameters. DeepSeek-V3's MTP modules are read from `model.layers.{num_hidden_layers + k}.*`
(baton.common.mtp's names); a checkpoint's per-module copies of the embedding and LM head are not
read: training shares the main model's, as DeepSeek-V3 does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from baton.common.checkpoint import CheckpointError, expected_shapes
from baton.common.config import ModelConfig
from baton.common.model import CausalLM
from baton.common.mtp import checkpoint_name, module_name
from baton.common.weight_slices import WeightSlices
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

if TYPE_CHECKING:
    from baton.train.config import TrainConfig
    from baton.train.distributed import Dist


class PretrainedWeights(Mapping[str, torch.Tensor]):
    """A checkpoint's weights (and persistent buffers) by training parameter name (a tied LM head is
    the embedding; MTP module k is `mtp.k.*`), read from its files on access, whole or one rank's
    slice, in float32. Made during the checks: a missing tensor or a shape that does not fit the
    config is a CheckpointError before any work."""

    def __init__(self, directory: str | Path, config: ModelConfig):
        self.directory, self.config = Path(directory), config
        self.slices = WeightSlices(directory)
        # Qwen3.5's own (multimodal) checkpoints keep the text model under model.language_model.*
        # beside the vision tower and mtp.* (neither is read; common.checkpoint.text_model_state).
        nested = any(k.startswith("model.language_model.") for k in self.slices.files)
        self.text_prefix = "model.language_model." if nested else "model."
        layers = config.num_hidden_layers
        self.shapes = {module_name(name, layers): shape for name, (shape, _) in expected_shapes(config).items()}
        for name, shape in self.shapes.items():
            source = self._source(name)
            if source not in self.slices:
                hint = (
                    " (fused Mixtral experts: run `baton convert --from-hf` first)"
                    if any(".experts.gate_up_proj" in k for k in self.slices.files)
                    else ""
                )
                raise CheckpointError(f"{directory} has no tensor {name!r}{hint}")
            if self.slices.shape(source) != tuple(shape):
                raise CheckpointError(
                    f"{directory}: tensor {source!r} is {self.slices.shape(source)}, the config says {tuple(shape)}"
                )

    def _source(self, name: str) -> str:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        source = checkpoint_name(name, self.config.num_hidden_layers)
        return self.text_prefix + source.removeprefix("model.") if source.startswith("model.") else source

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.slices.read(self._source(name)).float()

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def part(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The block of tensor `name` of `shape` starting at `offset`, read alone from the file."""
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        return self.slices.read(self._source(name), index).float()

    def full_model(self) -> CausalLM:
        """The whole model on the CPU in float32, each tensor read straight into place (copied out of
        the file: safetensors may hand back tensors that alias its read-only memory map)."""
        with torch.device("meta"):
            model = CausalLM(self.config)
        model.load_state_dict({n: self[n].clone() for n in self}, strict=False, assign=True)
        if self.config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        _check_loaded(model)
        return model

    @torch.no_grad()
    def materialize(self, modules: list[nn.Module], device: torch.device) -> None:
        """Allocate the meta-built (already parallelized) `modules` on `device` and fill them: a
        DTensor's local shard from its slice of the file, any other parameter whole. Call it after
        sharding and before an optimizer or DDP wrapper takes the parameters (to_empty replaces
        plain parameters; DTensor parameters are swapped in place, FSDP2 picks them up lazily)."""
        for module in modules:
            ties = _tied_names(module)
            module.to_empty(device=device)
            for name, source in ties:  # to_empty gives each plain parameter of a tie its own tensor
                if module.get_parameter(name) is not module.get_parameter(source):
                    parent, _, leaf = name.rpartition(".")
                    setattr(module.get_submodule(parent), leaf, module.get_parameter(source))
            for name, p in module.named_parameters():
                if isinstance(p, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                    local = p.to_local()
                    if tuple(local.shape) != tuple(shape):
                        raise RuntimeError(f"{name}: local shard {tuple(local.shape)}, placements say {tuple(shape)}")
                    if local.numel():
                        local.copy_(self.part(name, tuple(offset), tuple(shape)))
                else:
                    p.copy_(self[name])
            for name, b in module.named_buffers():  # (DeepSeek-V3's correction biases: whole on every rank)
                if name in self.shapes:
                    b.copy_(self[name])
            _check_loaded(module)


def _tied_names(module: nn.Module) -> list[tuple[str, str]]:
    """(name, name of the first parameter it is tied to) for every repeated parameter."""
    first: dict[int, str] = {}
    ties = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return ties


def _check_loaded(module: nn.Module) -> None:
    left = [n for n, p in module.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"init_from left parameters on the meta device: {', '.join(left[:5])}")
    for m in module.modules():  # RoPE's frequencies: a plain attribute, computed on the CPU even under meta
        if isinstance(getattr(m, "inv_freq", None), torch.Tensor) and m.inv_freq.is_meta:
            raise RuntimeError("RoPE inv_freq was left on the meta device")


def pretrained_model(cfg: TrainConfig, model_cfg: ModelConfig, dist: Dist, weights: PretrainedWeights) -> CausalLM:
    """The model for backend `cfg.backend` to start from `weights`: meta-built for torch3d (its
    backend materialises the shards), ZeRO-3 partitioned from birth, else whole."""
    if cfg.backend == "torch3d":
        with torch.device("meta"):
            return CausalLM(model_cfg)
    if cfg.backend == "deepspeed" and cfg.deepspeed.stage == 3:
        from baton.train.backends.deepspeed import zero3_model

        return zero3_model(cfg, model_cfg, dist, weights)
    return weights.full_model()
