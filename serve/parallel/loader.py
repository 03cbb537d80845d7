"""load_shard(): one rank's part of a checkpoint, read slice by slice from its safetensors files.

The model is built on the meta device (float, or the quantized skeleton its config describes),
cut by shard_model(), and each remaining tensor is read with safetensors' get_slice
(baton.common.weight_slices): only this rank's rows/columns leave the file, so no rank ever holds
the whole model. Every slice is checked against the local module's shape and dtype. A tied LM head on a last stage without the embedding
reads the embedding's tensor. The driver verifies the checkpoint's sha256s once before the
workers start; workers do not re-hash.
"""

from __future__ import annotations

from pathlib import Path

import torch

from baton.common.checkpoint import CheckpointError, read_config
from baton.common.model import CausalLM
from baton.common.weight_slices import WeightSlices
from baton.kernels.linear_cpu import PackedLinear
from baton.serve.parallel.shard import Shard, Slice, shard_model
from baton.serve.quantization.config import QuantConfig
from baton.serve.quantization.linear import set_compute_dtype
from baton.serve.quantization.loader import quantization_config, quantized_skeleton


def _skeleton(directory: Path, dtype: torch.dtype | None) -> tuple[CausalLM, QuantConfig | None]:
    config = read_config(directory)
    raw = quantization_config(directory)
    if raw is not None:
        qcfg = QuantConfig.from_hf(raw)
        model = quantized_skeleton(config, qcfg)
        if dtype is not None:  # only the float parts, as quantization/loader.py does: the rest are buffers
            for p in model.parameters():
                p.data = p.data.to(dtype)
        return model, qcfg
    with torch.device("meta"):
        return CausalLM(config).to(dtype or config.dtype), None


def _read(weights: WeightSlices, name: str, spec: Slice | None) -> torch.Tensor:
    if spec is None:
        return weights.read(name)
    stop = min(spec.stop, weights.shape(name)[spec.dim])
    t = weights.read(
        name, tuple(slice(spec.start, stop) if d == spec.dim else slice(None) for d in range(spec.dim + 1))
    )
    if t.shape[spec.dim] < spec.size:  # the padded end of a vocabulary split
        pad = list(t.shape)
        pad[spec.dim] = spec.size - t.shape[spec.dim]
        t = torch.cat([t, t.new_zeros(pad)], spec.dim)
    return t


def load_shard(
    directory: str | Path,
    shard: Shard,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    group=None,
) -> CausalLM:
    d = Path(directory)
    model, qcfg = _skeleton(d, dtype)
    specs = shard_model(model, shard, group)
    cfg = model.config
    files = WeightSlices(d)
    want = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    floats = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    state: dict[str, torch.Tensor] = {}
    for name, meta in want.items():
        source = name
        if name == "lm_head.weight" and cfg.tie_word_embeddings and name not in files:
            source = "model.embed_tokens.weight"
        if source not in files:
            raise CheckpointError(f"missing tensor {source!r} (expected {tuple(meta.shape)} {meta.dtype})")
        t = _read(files, source, specs.get(name))
        if name in floats and t.is_floating_point():
            t = t.to(meta.dtype)
        if t.shape != meta.shape or t.dtype != meta.dtype:
            raise CheckpointError(
                f"tensor {source!r}: this rank's slice is {tuple(t.shape)} {t.dtype}, the sharded model "
                f"expects {tuple(meta.shape)} {meta.dtype}"
            )
        state[name] = t.to(device).contiguous().clone()  # fresh, aligned storage (see quantization/loader.py)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings and shard.first_stage and shard.last_stage:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.inv_freq = model.model.inv_freq.to(device)  # a plain CPU attribute, not a buffer
    if qcfg is not None and torch.device(device).type == "cpu" and qcfg.format == "int8":
        set_compute_dtype(model, torch.bfloat16)  # as quantization/loader.py does, for the same reason
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors this rank holds (shared tensors counted once). A packed CPU linear
    (kernels/linear_cpu.py, held outside parameters and buffers) counts as its weight at the width
    it is packed in: MKL's fp32 pack reserves more address space than it touches (~8 MB even for a
    tiny matrix), and what is resident is the weight's own size, at 4 bytes where a bf16 weight
    was widened to fp32 (a CPU without oneDNN bf16)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, PackedLinear):
            total += m.out_features * m.in_features * m.packed.data.element_size()
            if m.bias is not None and m.bias.data_ptr() not in seen:
                seen.add(m.bias.data_ptr())
                total += m.bias.numel() * m.bias.element_size()
    for t in list(model.parameters()) + list(model.buffers()):
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
