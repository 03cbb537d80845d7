"""Hugging Face interop: config translation and checkpoint import/export.

Baton's parameter names are HF's on-disk names (Mixtral's per-expert w1/w2/w3 included), so
import and export move tensors unchanged; the work is in the config, which HF spells differently
across families and versions (transformers 5 folds rope_theta/rope_scaling into rope_parameters).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from baton.common.config import BAMBA_FIELDS, DTYPES, ConfigError, ModelConfig

log = logging.getLogger(__name__)

_TRANSFORMERS = threading.Lock()


def transformers_class(name: str) -> type:
    """A class from transformers, resolved under one lock. Its lazy top-level module is not safe when
    several threads resolve their first names at once (a server's first burst of chat requests got
    ImportError "cannot import name 'AutoTokenizer'"): every name Baton takes from it comes here."""
    with _TRANSFORMERS:
        import transformers

        return getattr(transformers, name)


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "bamba": "BambaForCausalLM",
}


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = d.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = d.get("rope_theta", 10000.0)
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else {}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """A Baton config from an HF config.json dict (Llama, Mistral, Qwen2, Mixtral or Bamba)."""
    model_type = d.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"unsupported model_type {model_type!r}: Baton reads {', '.join(ARCHITECTURES)}")
    if d.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported (Baton's SwiGLU MLP has no biases)")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported (Baton uses SwiGLU with silu)")
    theta, scaling = _rope_from_hf(d)
    dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r} in config.json")
    sliding, layer_types = None, None
    if model_type in ("mistral", "mixtral"):
        sliding = d.get("sliding_window")
    elif model_type == "qwen2" and d.get("use_sliding_window"):
        sliding = d.get("sliding_window")
        layer_types = d.get("layer_types") or [
            "sliding_attention" if i >= d.get("max_window_layers", 0) else "full_attention"
            for i in range(d["num_hidden_layers"])
        ]
    kwargs: dict[str, Any] = dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads"),
        head_dim=d.get("head_dim"),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        sliding_window=sliding,
        layer_types=layer_types,
        attention_bias=bool(d.get("attention_bias", False)) if model_type in ("llama", "bamba") else False,
        qkv_bias=model_type == "qwen2",
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        num_local_experts=d.get("num_local_experts", 0) if model_type == "mixtral" else 0,
        num_experts_per_tok=d.get("num_experts_per_tok", 2),
        initializer_range=d.get("initializer_range", 0.02),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
        torch_dtype=dtype,
        model_type=model_type,
        early_exit_layers=d.get("early_exit_layers"),
    )
    if model_type == "bamba":
        kwargs.update(_bamba_from_hf(d))
    return ModelConfig(**kwargs)


def _bamba_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    rope = d.get("rope_parameters") or {}
    if rope.get("partial_rotary_factor", 0.5) != 0.5:
        raise ConfigError("bamba rotates half of each head (partial_rotary_factor 0.5); got a different factor")
    out = {k: d[k] for k in BAMBA_FIELDS if k in d and d[k] is not None}
    if out.get("mamba_d_head") == "auto":
        out.pop("mamba_d_head")
    if "time_step_limit" in out:  # transformers 5 writes inf as {"__float__": "Infinity"}
        out["time_step_limit"] = [float(v["__float__"]) if isinstance(v, dict) else v for v in out["time_step_limit"]]
    return out


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """An HF config.json dict that transformers 4.x and 5.x both read as the same model."""
    rope_parameters = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})}
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
        "initializer_range": cfg.initializer_range,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.torch_dtype,
        "rope_parameters": rope_parameters,
        "use_cache": True,
    }
    if cfg.early_exit_layers is not None:  # Baton's LayerSkip exits; transformers keeps it as an attribute
        d["early_exit_layers"] = list(cfg.early_exit_layers)
    if cfg.model_type == "llama":
        d.update(attention_bias=cfg.attention_bias, mlp_bias=False)
    elif cfg.model_type in ("mistral", "mixtral"):
        d["sliding_window"] = cfg.sliding_window
    if cfg.model_type == "bamba":
        d.update({k: getattr(cfg, k) for k in BAMBA_FIELDS}, attention_bias=cfg.attention_bias, mlp_bias=False)
        d["attn_layer_indices"] = d["attn_layer_indices"] or []
        d["rope_parameters"] = {**rope_parameters, "partial_rotary_factor": 0.5}
    if cfg.model_type == "mixtral":
        d.update(num_local_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok)
    if cfg.model_type == "qwen2":
        layer_types = (
            cfg.layer_types or ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.num_hidden_layers
        )
        first_sliding = next((i for i, t in enumerate(layer_types) if t == "sliding_attention"), cfg.num_hidden_layers)
        d.update(
            use_sliding_window=cfg.sliding_window is not None,
            sliding_window=cfg.sliding_window,
            max_window_layers=first_sliding,
            layer_types=layer_types,
        )
    return d


# ---------------------------------------------------------------------------- tensor names
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def normalize_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Accept transformers-5 in-memory names too: fused expert tensors are split per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _FUSED_EXPERTS.match(name)
        if m:
            prefix, kind = m.groups()
            for e in range(t.shape[0]):
                base = f"{prefix}.block_sparse_moe.experts.{e}"
                if kind == "gate_up_proj":
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{base}.w1.weight"], out[f"{base}.w3.weight"] = gate.contiguous(), up.contiguous()
                else:
                    out[f"{base}.w2.weight"] = t[e].contiguous()
            continue
        if cfg.model_type == "mixtral":
            name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        out[name] = t
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


# ---------------------------------------------------------------------------- directories
def import_hf(hf_dir: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Turn a local HF checkpoint directory (save_pretrained layout) into a Baton checkpoint."""
    from baton.common.checkpoint import HandoffMetadata, load_state_dict, read_config, save_checkpoint

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
    from baton.common.checkpoint import TOKENIZER_FILES, atomic_directory, load_state_dict, read_config, write_weights

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
