"""Hugging Face interop: checkpoint import/export, transformers names under one lock.

Baton's parameter names are HF's on-disk names (Mixtral's per-expert w1/w2/w3 included), so
import and export move tensors unchanged; the work is in the config, which HF spells differently
across families and versions: that translation is common/hf_config.py (below common/checkpoint.py,
which reads and writes config.json too), and its names are re-exported here.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from pathlib import Path

import torch
from baton.common.checkpoint import (
    TOKENIZER_FILES,
    HandoffMetadata,
    atomic_directory,
    load_state_dict,
    read_config,
    save_checkpoint,
    text_model_state,
    write_weights,
)
from baton.common.config import DTYPES, ConfigError, ModelConfig
from baton.common.hf_config import ARCHITECTURES, config_from_hf, config_to_hf
from baton.common.moe import Qwen3Expert
from baton.common.mxfp4 import dequantize_state_dict

__all__ = [
    "ARCHITECTURES",
    "config_from_hf",
    "config_to_hf",
    "export_hf",
    "import_hf",
    "normalize_hf_state_dict",
    "transformers_class",
]

log = logging.getLogger(__name__)

_TRANSFORMERS = threading.Lock()


def transformers_class(name: str) -> type:
    """A class from transformers, resolved under one lock. Its lazy top-level module is not safe when
    several threads resolve their first names at once (a server's first burst of chat requests got
    ImportError "cannot import name 'AutoTokenizer'"): every name Baton takes from it comes here."""
    with _TRANSFORMERS:
        import transformers

        return getattr(transformers, name)


# ---------------------------------------------------------------------------- tensor names
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# Per family with per-expert modules: the MoE block's name and its experts' (gate, up, down) names.
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", Qwen3Expert.names),
    "deepseek_v3": ("mlp", Qwen3Expert.names),
    "qwen3_next": ("mlp", Qwen3Expert.names),
    "qwen3_5_moe_text": ("mlp", Qwen3Expert.names),
}


def normalize_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF's tensors under Baton's (= HF's on-disk) names. Also accepted:

    - transformers-5 in-memory names (a state dict saved from a loaded model): Mixtral's, Qwen3-MoE's,
      Qwen3-Next's, Qwen3.5-MoE's and DeepSeek-V3's fused `mlp.experts.gate_up_proj` [E, 2I, H] (gate
      rows, then up) and `down_proj` [E, H, I] are split per expert (gpt-oss's stacked experts are its
      checkpoint names: kept);
    - MXFP4 expert weights (gpt-oss hub checkpoints, `quantization_config.quant_method: mxfp4`):
      `*_blocks`/`*_scales` are dequantized to the bf16 layout, in the dtype of the checkpoint's
      other weights (baton.common.mxfp4);
    - Qwen3.5's model.language_model.* names (its vision tower and both families' mtp.* dropped:
      checkpoint.text_model_state)."""
    state = text_model_state(state, cfg)
    if any(name.endswith("_blocks") for name in state):
        state = dequantize_state_dict(state, _weights_dtype(state, cfg))
    out: dict[str, torch.Tensor] = {}
    split = _EXPERT_NAMES.get(cfg.model_type)
    for name, t in state.items():
        m = _FUSED_EXPERTS.match(name) if split else None
        if m:
            prefix, kind = m.groups()
            block, (gate_name, up_name, down_name) = split
            for e in range(t.shape[0]):
                base = f"{prefix}.{block}.experts.{e}"
                if kind == "gate_up_proj":
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{base}.{gate_name}.weight"] = gate.contiguous()
                    out[f"{base}.{up_name}.weight"] = up.contiguous()
                else:
                    out[f"{base}.{down_name}.weight"] = t[e].contiguous()
            continue
        if cfg.model_type == "mixtral":
            name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        out[name] = t
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _weights_dtype(state: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.dtype:
    """The floating dtype most of the checkpoint's tensors have (config.json's where none)."""
    counts: dict[torch.dtype, int] = {}
    for t in state.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
    return max(counts, key=counts.get) if counts else cfg.dtype


# ---------------------------------------------------------------------------- directories
def import_hf(hf_dir: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Turn a local HF checkpoint directory (save_pretrained layout) into a Baton checkpoint."""
    hf_dir = Path(hf_dir)
    cfg = read_config(hf_dir)
    state = normalize_hf_state_dict(load_state_dict(hf_dir), cfg)
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        cfg.torch_dtype = dtype
        state = {k: v.to(DTYPES[dtype]) for k, v in state.items()}
    elif state:
        stored = {v.dtype for v in state.values()}
        if len(stored) == 1:  # the tensors are the truth when config.json's dtype is stale
            cfg.torch_dtype = {v: k for k, v in DTYPES.items()}[stored.pop()]
    meta = HandoffMetadata(producer="baton convert --from-hf", extra={"source": str(hf_dir.resolve())})
    log.info("importing %s (%s) into %s", hf_dir, cfg.model_type, out_dir)
    return save_checkpoint(out_dir, cfg, state, tokenizer_dir=hf_dir, metadata=meta)


def export_hf(baton_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a plain HF directory (no baton.json) that transformers loads unchanged."""
    baton_dir = Path(baton_dir)
    cfg = read_config(baton_dir)
    state = load_state_dict(baton_dir)
    with atomic_directory(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
        write_weights(tmp, state, max_shard_bytes=5 * 1024**3)
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
        (tmp / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}) + "\n")
        for name in TOKENIZER_FILES:
            if (baton_dir / name).is_file():
                shutil.copy2(baton_dir / name, tmp / name)
    log.info("exported %s to HF format at %s", baton_dir, out_dir)
    return Path(out_dir)
