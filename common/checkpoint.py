"""The handoff checkpoint: what the trainer writes and the server loads.

A directory that transformers can also load unchanged:
    config.json                        HF-compatible config (architectures, model_type, ...)
    model.safetensors                  or model-0000i-of-0000n.safetensors + model.safetensors.index.json
    tokenizer.json, tokenizer_config.json
    baton.json                         what produced it: step, tokens seen, layout, dtype, sha256s

Writes are atomic: everything goes to a hidden temporary sibling, is fsynced, and is swapped into
place with one rename, so a crash mid-save leaves the previous checkpoint intact. Tensors are
safetensors only; nothing is ever unpickled. One writer per checkpoint path is assumed.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from baton.common.config import ModelConfig
from baton.common.hf_config import config_from_hf, config_to_hf
from baton.common.model import CausalLM
from baton.common.mtp import COPY_NAMES, module_name, mtp_layer_of
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
METADATA_FILE = "baton.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or does not match its config."""


@dataclass
class LoadedCheckpoint:
    model: CausalLM
    config: ModelConfig
    metadata: dict[str, Any]
    path: Path
    tokenizer_path: Path | None = None


@dataclass
class HandoffMetadata:
    """Provenance recorded in baton.json."""

    producer: str = "baton"
    step: int | None = None
    tokens_seen: int | None = None
    parallel_layout: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------- atomic writes
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling to fill; on success it replaces `target` in one step.

    If the body raises (or the process dies), `target` is untouched; the leftover temporary
    directory is hidden and removed by the next save to the same target.
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync_path(f)
        _fsync_path(tmp)
        if target.exists():
            if not _exchange(tmp, target):  # fall back: move the old one aside, then rename
                aside = target.parent / f".{target.name}.tmp-old-{uuid.uuid4().hex[:8]}"
                os.rename(target, aside)
                os.rename(tmp, target)
                tmp = aside
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.rename(tmp, target)
        _fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------------- writing
def _shard(state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_weights(directory: Path, state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """Write safetensors in HF's layout (one file, or shards + index); return the file names."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    shards = _shard(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, directory / SINGLE_FILE, metadata={"format": "pt"})
        return [SINGLE_FILE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / fname, metadata={"format": "pt"})
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return names + [INDEX_FILE]


def save_beside(
    directory: str | Path, module: torch.nn.Module, config: Any, weights_file: str, config_file: str
) -> None:
    """A small trained module kept beside a checkpoint (Medusa heads, an EAGLE head, a router):
    weights first, config (a dataclass) last, each via a temporary file and rename - a crash leaves
    the previous module or none readable, never a config pointing at half-written weights."""
    from dataclasses import asdict

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{weights_file}.tmp"
    weights = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    save_file(weights, tmp, metadata={"format": "pt"})
    os.replace(tmp, d / weights_file)
    tmp = d / f".{config_file}.tmp"
    tmp.write_text(json.dumps(asdict(config), indent=2) + "\n")
    os.replace(tmp, d / config_file)


def save_checkpoint(
    out_dir: str | Path,
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    *,
    tokenizer: Any = None,
    tokenizer_dir: str | Path | None = None,
    metadata: HandoffMetadata | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a handoff checkpoint atomically. `tokenizer` is anything with `.save(dir)`;
    `tokenizer_dir` is a directory whose tokenizer files are copied instead."""
    validate_state_dict(state_dict, config)
    metadata = metadata or HandoffMetadata()
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
        files = write_weights(tmp, state_dict, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save(tmp)
        elif tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).exists():
                    shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
        files += [n for n in TOKENIZER_FILES if (tmp / n).exists()] + ["config.json"]
        meta = {
            "format": "baton-checkpoint",
            "format_version": FORMAT_VERSION,
            "producer": metadata.producer,
            "created_unix": time.time(),
            "step": metadata.step,
            "tokens_seen": metadata.tokens_seen,
            "parallel_layout": metadata.parallel_layout,
            "dtype": config.torch_dtype,
            "num_parameters": sum(t.numel() for t in state_dict.values()),
            "sha256": {name: sha256_file(tmp / name) for name in sorted(files)},
            **metadata.extra,
        }
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    log.info("saved checkpoint to %s (%d tensors, %s)", out_dir, len(state_dict), config.torch_dtype)
    return out_dir


def save_model(out_dir: str | Path, model: CausalLM, **kwargs: Any) -> Path:
    return save_checkpoint(out_dir, model.config, model.checkpoint_state_dict(), **kwargs)


# ------------------------------------------------------------------------------------- reading
def read_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a checkpoint: it has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    config = config_from_hf(raw)
    names = tensor_names(directory) if config.num_nextn_predict_layers else None
    return config if names is None else reconcile_mtp(config, names)


def tensor_names(directory: str | Path) -> list[str] | None:
    """The tensors a checkpoint directory holds (from the index or the file header, no data read);
    None where it holds no safetensors (a config-only directory)."""
    d = Path(directory)
    if (d / INDEX_FILE).is_file():
        return list(json.loads((d / INDEX_FILE).read_text())["weight_map"])
    if (d / SINGLE_FILE).is_file():
        with safe_open(d / SINGLE_FILE, framework="pt") as f:
            return list(f.keys())
    return None


def weight_files(directory: str | Path) -> list[Path]:
    d = Path(directory)
    if (d / INDEX_FILE).is_file():
        index = json.loads((d / INDEX_FILE).read_text())
        return [d / f for f in sorted(set(index["weight_map"].values()))]
    if (d / SINGLE_FILE).is_file():
        return [d / SINGLE_FILE]
    pickled = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
    hint = f" (found {pickled[0]}; pickled weights are never loaded: re-save with safetensors)" if pickled else ""
    raise CheckpointError(f"{d} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def load_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        if not path.is_file():
            raise CheckpointError(f"weight shard {path.name} listed in the index is missing from {directory}")
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                state[name] = f.get_tensor(name)
    return state


def expected_shapes(config: ModelConfig) -> dict[str, tuple[torch.Size, torch.dtype]]:
    with torch.device("meta"):
        model = CausalLM(config).to(config.dtype)
    return {k: (v.shape, v.dtype) for k, v in model.checkpoint_state_dict().items()}


def validate_state_dict(state_dict: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Raise CheckpointError naming the first tensor that does not fit the config."""
    expected = expected_shapes(config)
    for name, (shape, dtype) in expected.items():
        if name not in state_dict:
            raise CheckpointError(f"missing tensor {name!r} (expected shape {tuple(shape)})")
        t = state_dict[name]
        if t.shape != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, config expects {tuple(shape)}")
        if t.dtype != dtype:
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, config says {config.torch_dtype}")
    copies = mtp_copy_names(config)
    for name in copies & set(state_dict):
        want = (config.vocab_size, config.hidden_size)
        if tuple(state_dict[name].shape) != want:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(state_dict[name].shape)}, expected {want}")
    unexpected = sorted(set(state_dict) - set(expected) - copies)
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} not in the model described by the config")


def mtp_copy_names(config: ModelConfig) -> set[str]:
    """The optional per-MTP-module copies of the embedding and LM head a checkpoint may carry."""
    n = config.num_hidden_layers
    return {f"model.layers.{n + k}.{c}" for k in range(config.num_nextn_predict_layers) for c in COPY_NAMES}


def reconcile_mtp(config: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """`config` with num_nextn_predict_layers 0 where the checkpoint holds no MTP tensors: DeepSeek-V3
    configs (transformers' own save_pretrained included) say 1 whether or not the weights are there.
    Some but not all of a module's tensors stay an error (validate_state_dict names the missing one)."""
    n = config.num_hidden_layers
    # (a training checkpoint holds them under their parameter names, mtp.{k}.*)
    if config.num_nextn_predict_layers == 0 or any(
        mtp_layer_of(name, n) is not None or name.startswith("mtp.") for name in names
    ):
        return config
    log.info(
        "config.json says num_nextn_predict_layers=%d but the checkpoint has no model.layers.%d.* tensors: "
        "no MTP modules (num_nextn_predict_layers set to 0)",
        config.num_nextn_predict_layers,
        n,
    )
    return dataclasses.replace(config, num_nextn_predict_layers=0)


def text_model_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A Qwen3.5 / Qwen3-Next checkpoint's text model under Baton's names. Qwen3.5's own checkpoints
    (Qwen3_5ForConditionalGeneration's) keep it under model.language_model.* beside the vision tower
    (model.visual.*), and both families ship an MTP head as mtp.*, which Baton, like transformers'
    *ForCausalLM, does not hold: the prefix is dropped, the tower and the head too (logged); A_log and
    dt_bias come in the config's dtype. Other families' state dicts are returned unchanged."""
    if config.mixer != "gated_deltanet":
        return state
    out, dropped = {}, []
    for name, t in state.items():
        if name.startswith(("mtp.", "model.visual.")):
            dropped.append(name)
            continue
        if name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")) and t.dtype != config.dtype:
            t = t.to(config.dtype)  # (some keep them in float32; transformers loads them in the model's)
        out[name.replace("model.language_model.", "model.", 1)] = t
    if dropped:
        kinds = sorted({n.split(".")[0] if n.startswith("mtp.") else "model.visual" for n in dropped})
        log.info("%d tensors under %s not loaded (Baton reads the text model only)", len(dropped), kinds)
    return out


def _split_mtp_copies(state: dict[str, torch.Tensor], config: ModelConfig) -> list[str]:
    """Drop the MTP embedding/head copies that equal the main model's (DeepSeek-V3 shares them, so
    holding them would cost a second embedding and head); return the names of those that differ."""
    embed = state.get("model.embed_tokens.weight")
    head = state.get("lm_head.weight", embed)
    kept = []
    for name in sorted(mtp_copy_names(config) & set(state)):
        main = embed if name.endswith("embed_tokens.weight") else head
        if main is not None and torch.equal(state[name], main):
            del state[name]
        else:
            kept.append(name)
    return kept


def verify_hashes(directory: str | Path) -> None:
    d = Path(directory)
    meta = read_metadata(d)
    for name, digest in meta.get("sha256", {}).items():
        if not (d / name).is_file():
            raise CheckpointError(f"{d}: file {name} recorded in {METADATA_FILE} is missing")
        if sha256_file(d / name) != digest:
            raise CheckpointError(f"{d}: {name} does not match its sha256 in {METADATA_FILE} (corrupted or edited)")


def read_metadata(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / METADATA_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def load_checkpoint(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, verify: bool = True
) -> LoadedCheckpoint:
    """Load a handoff checkpoint (or any HF Llama/Mistral/Qwen2/Mixtral safetensors directory)."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {d} does not exist")
    config = read_config(d)
    if verify:
        verify_hashes(d)
    state = text_model_state(load_state_dict(d), config)
    own_copies = _split_mtp_copies(state, config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    validate_state_dict(state, config)
    n = config.num_hidden_layers
    with torch.device("meta"):
        model = CausalLM(config)
        for name in own_copies:  # (an MTP module's embedding/head that is not the main model's)
            model.mtp[mtp_layer_of(name, n)].add_copy(name.split(".", 3)[3])
    state = {module_name(k, n): v for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)  # lm_head is tied when missing
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype or config.dtype)
    tok = d / "tokenizer.json"
    return LoadedCheckpoint(model, config, read_metadata(d), d, tok if tok.is_file() else None)
