"""Quantized handoff checkpoints: the usual directory (config.json, safetensors, tokenizer,
baton.json with sha256s) with a `quantization_config` block in config.json and the quantized
modules' buffers (qweight, scales, qzeros) as tensors. Written atomically like every checkpoint.

common.checkpoint.load_checkpoint validates every tensor against a float model, so quantized
checkpoints load here: the float skeleton is built, the quantized modules are swapped in as the
config says, and every tensor is checked against that (name, shape, dtype) before loading.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from baton.common.checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    FORMAT_VERSION,
    METADATA_FILE,
    TOKENIZER_FILES,
    CheckpointError,
    LoadedCheckpoint,
    atomic_directory,
    load_checkpoint,
    load_state_dict,
    mtp_copy_names,
    read_config,
    read_metadata,
    sha256_file,
    verify_hashes,
    write_weights,
)
from baton.common.hf import config_to_hf
from baton.common.mla import MLAttention
from baton.common.model import CausalLM
from baton.common.mtp import module_name, mtp_layer_of
from baton.serve.quantization.config import QuantConfig
from baton.serve.quantization.linear import FORMATS, set_compute_dtype, set_module, target_linears


def quantization_config(directory: str | Path) -> dict[str, Any] | None:
    """The raw quantization_config block of a checkpoint's config.json, or None for a float one."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a checkpoint: it has no config.json")
    return json.loads(path.read_text()).get("quantization_config")


def quantization_block(model: CausalLM, qcfg: QuantConfig) -> dict[str, Any]:
    """config.json's quantization_config; modules_to_not_convert names MLA's float kv_b_proj where the
    model has one (linear.absorbed_linears says why it stays float)."""
    block = qcfg.to_hf()
    if any(isinstance(m, MLAttention) for m in model.modules()):
        block["modules_to_not_convert"].append("kv_b_proj")
    return block


def save_quantized(
    out_dir: str | Path,
    model: CausalLM,
    qcfg: QuantConfig,
    *,
    tokenizer_dir: str | Path | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    state = model.checkpoint_state_dict()
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        cfg = config_to_hf(model.config)
        cfg["quantization_config"] = quantization_block(model, qcfg)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        files = write_weights(tmp, state, DEFAULT_MAX_SHARD_BYTES)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    (tmp / name).write_bytes((Path(tokenizer_dir) / name).read_bytes())
        files += [n for n in TOKENIZER_FILES if (tmp / n).exists()] + ["config.json"]
        meta = {
            "format": "baton-checkpoint",
            "format_version": FORMAT_VERSION,
            "producer": "baton quantize",
            "created_unix": time.time(),
            "dtype": model.config.torch_dtype,
            "quantization": quantization_block(model, qcfg),
            "sha256": {name: sha256_file(tmp / name) for name in sorted(files)},
            **(extra or {}),
        }
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


def quantized_skeleton(config, qcfg: QuantConfig, mtp_copies: Iterable[str] = ()) -> CausalLM:
    """A meta-device model in the config's dtype with empty quantized modules in place; `mtp_copies`:
    the checkpoint names of the MTP modules' own embedding/head copies it holds (common/mtp.py)."""
    with torch.device("meta"):
        model = CausalLM(config)
        for name in mtp_copies:
            model.mtp[mtp_layer_of(name, config.num_hidden_layers)].add_copy(name.split(".", 3)[3])
        model = model.to(config.dtype)  # (before the swap: the quantized modules' scales stay fp32)
        for name, lin in target_linears(model).items():
            set_module(
                model,
                name,
                FORMATS[qcfg.format](lin.in_features, lin.out_features, lin.bias is not None, qcfg.group_size),
            )
    return model


def load_quantized(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, verify: bool = True
) -> LoadedCheckpoint:
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d} does not exist")
    config, qcfg = read_config(d), QuantConfig.from_hf(quantization_config(d))
    if verify:
        verify_hashes(d)
    state = load_state_dict(d)
    model = quantized_skeleton(config, qcfg, sorted(mtp_copy_names(config) & set(state)))
    expected = model.checkpoint_state_dict()
    for name, want in expected.items():
        got = state.get(name)
        if got is None:
            raise CheckpointError(f"missing tensor {name!r} (expected {tuple(want.shape)} {want.dtype})")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise CheckpointError(
                f"tensor {name!r} is {tuple(got.shape)} {got.dtype}; the {qcfg.format} "
                f"quantization_config expects {tuple(want.shape)} {want.dtype}"
            )
    unexpected = sorted(set(state) - set(expected) - {"lm_head.weight"})
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} not in the quantized model the config describes")
    # Fresh (64-byte aligned) copies: torch's CPU int8 GEMM with bf16 activations reads the weight
    # with aligned vector loads and crashes on a tensor at an arbitrary offset in a safetensors file.
    n = config.num_hidden_layers  # (module_name: DeepSeek-V3's MTP tensors are model.layers.{n + k}.* on disk)
    model.load_state_dict({module_name(k, n): state[k].clone() for k in expected}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device)
    if torch.device(device).type == "cpu" and qcfg.format == "int8":
        # torch's CPU int8-weight GEMM is ~2x faster than an fp32 GEMM with bf16 activations and ~12x
        # slower with fp32 ones; the perplexity cost is nil (docs/benchmarks.md, Quantization).
        set_compute_dtype(model, torch.bfloat16)
    if dtype is not None:  # only the float parts: quantized modules hold buffers, not parameters
        for p in model.parameters():
            p.data = p.data.to(dtype)
    tok = d / "tokenizer.json"
    return LoadedCheckpoint(model, config, read_metadata(d), d, tok if tok.is_file() else None)


def load_model(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, verify: bool = True
) -> LoadedCheckpoint:
    """Any Baton checkpoint, float or quantized."""
    if quantization_config(directory) is not None:
        return load_quantized(directory, device, dtype, verify)
    return load_checkpoint(directory, device, dtype, verify)
