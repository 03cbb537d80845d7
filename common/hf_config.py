"""Hugging Face config.json <-> Baton's ModelConfig, for every family Baton reads.

HF spells the same model differently across families and versions (transformers 5 folds
rope_theta/rope_scaling into rope_parameters); the translation lives here, below both its users:
common/checkpoint.py (a checkpoint's config.json is HF's) and common/hf.py (import/export of
whole HF directories, which re-exports these names).
"""

from __future__ import annotations

import logging
from typing import Any

from baton.common.config import BAMBA_FIELDS, DTYPES, HIDDEN_ACTS, LAYER_TYPES, ConfigError, ModelConfig
from baton.common.families import DELTANET_DEFAULTS, DELTANET_FAMILIES

log = logging.getLogger(__name__)

MOE_TYPES = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_next", "qwen3_5_moe_text")

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "bamba": "BambaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
# transformers' DeepseekV3Config defaults: what a config.json that leaves a key out means.
DEEPSEEK_HF_DEFAULTS: dict[str, Any] = dict(
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_interleave=True,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    first_k_dense_replace=3,
    moe_intermediate_size=2048,
    norm_topk_prob=True,
)
# DeepSeek's own routing keys (its remote-code configs carry them); the only values HF's class implements.
DEEPSEEK_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
# Families whose config.json spells layer_types / sliding_window the way transformers 5 does.
LAYER_TYPED = ("qwen3", "qwen3_moe", "gemma2", "gemma3_text", "gpt_oss")
# Multimodal wrappers whose text model Baton reads under its own model_type.
TEXT_ONLY = {"gemma3": "gemma3_text"}
# ... and those whose config.json nests it (text_config): Baton reads that part, and a checkpoint's
# weights under model.language_model.* (checkpoint.text_model_state drops the vision tower's).
NESTED_TEXT = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# transformers' defaults of the DeltaNet families' MoE fields (Qwen3-Next's, then Qwen3.5-MoE's)
DELTANET_MOE_DEFAULTS = {
    "qwen3_next": dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512),
    "qwen3_5_moe_text": dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512),
}
# Rope keys that are not a frequency scaling: the rotated share (the families' own field) and
# Qwen3.5's multimodal rope sections, which are plain rope for text (every section the same position).
ROPE_EXTRA_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (Gemma 3): the full layers'
        params = params["full_attention"]
    if isinstance(params, dict):  # transformers >= 5
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = d.get("rope_theta", 10000.0)
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else {}
    for key in ROPE_EXTRA_KEYS:
        scaling.pop(key, None)
    if "type" in scaling:  # (the old spelling; transformers 5 writes both)
        scaling.setdefault("rope_type", scaling["type"])
        scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """A Baton config from an HF config.json dict (any family in ARCHITECTURES, or a multimodal
    Qwen3.5 config's text part)."""
    d = _text_config(d)
    model_type = d.get("model_type")
    if model_type in TEXT_ONLY:
        raise ConfigError(
            f"model_type {model_type!r} is a multimodal checkpoint; Baton reads its text model "
            f"(model_type {TEXT_ONLY[model_type]!r}, {ARCHITECTURES[TEXT_ONLY[model_type]]})"
        )
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"unsupported model_type {model_type!r}: Baton reads {', '.join(ARCHITECTURES)}")
    if d.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported (Baton's SwiGLU MLP has no biases)")
    act = d.get("hidden_activation") or d.get("hidden_act", "silu")  # (Gemma spells it hidden_activation)
    if act not in HIDDEN_ACTS:
        raise ConfigError(f"hidden_act {act!r} is not supported (Baton's gated MLPs use one of {HIDDEN_ACTS})")
    theta, scaling = _rope_from_hf(d)
    dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r} in config.json")
    sliding, layer_types = None, None
    if model_type in ("mistral", "mixtral"):
        sliding = d.get("sliding_window")
    elif model_type in LAYER_TYPED:
        sliding, layer_types = _layer_types_from_hf(d, model_type)
    elif model_type == "qwen2" and d.get("use_sliding_window"):
        sliding = d.get("sliding_window")
        layer_types = d.get("layer_types") or [
            "sliding_attention" if i >= d.get("max_window_layers", 0) else "full_attention"
            for i in range(d["num_hidden_layers"])
        ]
    kwargs: dict[str, Any] = dict(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        # (Qwen3.5-MoE has no dense MLP and no intermediate_size: its experts' width stands in)
        intermediate_size=d["intermediate_size"] if "intermediate_size" in d else _expert_width(d),
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
        attention_bias=bool(d.get("attention_bias", False))
        if model_type not in ("mistral", "qwen2", "mixtral")
        else False,
        qkv_bias=model_type == "qwen2",
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        num_local_experts=_num_experts(d) if model_type in MOE_TYPES else 0,
        num_experts_per_tok=d.get("num_experts_per_tok", 2),
        initializer_range=d.get("initializer_range", 0.02),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
        torch_dtype=dtype,
        model_type=model_type,
        early_exit_layers=d.get("early_exit_layers"),
        hidden_act=act,
    )
    if model_type == "bamba":
        kwargs.update(_bamba_from_hf(d))
    if model_type in DELTANET_FAMILIES:
        kwargs.update(_deltanet_from_hf(d, model_type))
    kwargs.update(_family_from_hf(d, model_type))
    return ModelConfig(**kwargs)


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Qwen3.5 config.json's text_config, with the keys its wrapper holds for it: dtype and
    token ids where the text part leaves them out, and tied embeddings always (transformers ties the
    wrapper's lm_head by the wrapper's own flag); any other dict unchanged."""
    outer = d.get("model_type")
    if outer not in NESTED_TEXT:
        return d
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"model_type {outer!r} is a multimodal config: its text model must be in text_config")
    inherited = ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id")
    text = {**{k: d[k] for k in inherited if k in d}, "model_type": NESTED_TEXT[outer], **text}
    text["tie_word_embeddings"] = d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    log.info(
        "config.json is a multimodal %s model: reading its text model (%s, %s); the vision tower is not loaded",
        outer,
        text["model_type"],
        ARCHITECTURES.get(text["model_type"], "?"),
    )
    return text


def _expert_width(d: dict[str, Any]) -> int:
    return d.get(
        "moe_intermediate_size", DELTANET_MOE_DEFAULTS.get(d.get("model_type"), {}).get("moe_intermediate_size", 0)
    )


def _deltanet_from_hf(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Qwen3.5 / Qwen3-Next fields, transformers' defaults where config.json leaves them out."""
    n = d["num_hidden_layers"]
    out: dict[str, Any] = {k: d.get(k, v) for k, v in DELTANET_DEFAULTS.items() if k != "partial_rotary_factor"}
    rope = d.get("rope_parameters") or {}
    out["partial_rotary_factor"] = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    step = d.get("full_attention_interval", 4)
    types = d.get("layer_types") or ["full_attention" if (i + 1) % step == 0 else "linear_attention" for i in range(n)]
    out.update(layer_types=list(types), sliding_window=None, head_dim=d.get("head_dim", 256))
    moe = DELTANET_MOE_DEFAULTS.get(model_type)
    if moe is None:
        return out
    experts = d.get("num_experts", moe["num_experts"])
    out.update(
        num_local_experts=experts,
        num_experts_per_tok=d.get("num_experts_per_tok", moe["num_experts_per_tok"]),
        moe_intermediate_size=_expert_width(d),
        shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 512) if experts else None,
    )
    if model_type == "qwen3_next":
        out.update(
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            mlp_only_layers=list(d.get("mlp_only_layers") or []) or None,
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
        )
    return out


def _layer_types_from_hf(d: dict[str, Any], model_type: str) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) of a transformers-5 family: layer_types when written, else
    the family's rule (Qwen3: max_window_layers; Gemma 3: every 6th layer full; gpt-oss: alternating)."""
    n, window, types = d["num_hidden_layers"], d.get("sliding_window"), d.get("layer_types")
    if model_type in ("qwen3", "qwen3_moe") and not d.get("use_sliding_window"):
        return None, None  # (layer_types says "sliding" only where use_sliding_window turns it on)
    if types is None and model_type == "gemma3_text":
        step = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        types = ["full_attention" if (i + 1) % step == 0 else "sliding_attention" for i in range(n)]
    elif types is None and model_type in ("gpt_oss", "gemma2"):
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    elif types is None:
        types = ["sliding_attention" if i >= d.get("max_window_layers", 0) else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types {unknown} are not supported (Baton's attention layers are {LAYER_TYPES})")
    if window is None or "sliding_attention" not in types:
        return None, None
    return window, types


def _num_experts(d: dict[str, Any]) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):  # Mixtral/gpt-oss, Qwen3-MoE, DeepSeek
        if d.get(key) is not None:
            return d[key]
    return 256 if d.get("model_type") == "deepseek_v3" else 0  # (DeepseekV3Config's default)


def _deepseek_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    for key, value in DEEPSEEK_ROUTING.items():
        if d.get(key, value) != value:
            raise ConfigError(
                f"deepseek_v3: {key}={d[key]!r} is not supported (Baton, like transformers, implements {key}={value!r})"
            )
    out = {k: d.get(k, v) for k, v in DEEPSEEK_HF_DEFAULTS.items()}
    mtp = d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 1))
    return {**out, "num_nextn_predict_layers": mtp or 0}


def _family_from_hf(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The newer families' own fields (ModelConfig fills and checks the features each one fixes)."""
    out: dict[str, Any] = {}
    if model_type == "deepseek_v3":
        out.update(_deepseek_from_hf(d))
    if model_type == "qwen3_moe":
        out.update(
            moe_intermediate_size=d.get("moe_intermediate_size"),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            mlp_only_layers=list(d.get("mlp_only_layers") or []) or None,
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
        )
    if model_type == "gpt_oss":
        out.update(swiglu_alpha=d.get("swiglu_alpha", 1.702), swiglu_limit=d.get("swiglu_limit", 7.0))
    if model_type == "gemma2":
        out.update(
            {k: d.get(k) for k in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")}
        )
    if model_type == "gemma3_text":
        if d.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention=true (Gemma 3 as an encoder) is not supported")
        if d.get("attn_logit_softcapping") is not None:
            raise ConfigError(
                "attn_logit_softcapping is set, but transformers' Gemma 3 never applies it: Baton refuses rather "
                "than serve other numbers than transformers (set it to null; Gemma 2 is the family that caps)"
            )
        local = (d.get("rope_parameters") or {}).get("sliding_attention") or {
            "rope_theta": d.get("rope_local_base_freq", 10000.0)
        }
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.sliding_attention: rope_type {local['rope_type']!r} is not supported")
        out.update(
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            sliding_rope_theta=float(local["rope_theta"]),
        )
    return out


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
    _family_to_hf(cfg, d)
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


def _family_to_hf(cfg: ModelConfig, d: dict[str, Any]) -> None:
    """The newer families' keys, spelled as transformers 5.25 writes them."""
    t = cfg.model_type
    if t == "deepseek_v3":
        d.update({name: getattr(cfg, name) for name in DEEPSEEK_HF_DEFAULTS}, **DEEPSEEK_ROUTING)
        d.update(
            attention_bias=cfg.attention_bias,
            moe_intermediate_size=cfg.expert_intermediate_size,
            n_routed_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            num_nextn_predict_layers=cfg.num_nextn_predict_layers,
        )
    if t in DELTANET_FAMILIES:
        _deltanet_to_hf(cfg, d)
    if t not in LAYER_TYPED and t != "olmo2":
        return
    d["attention_bias"] = cfg.attention_bias
    if t in LAYER_TYPED:
        d["sliding_window"] = cfg.sliding_window
        d["layer_types"] = [
            "sliding_attention" if cfg.is_sliding(i) else "full_attention" for i in range(cfg.num_hidden_layers)
        ]
    if t in ("qwen3", "qwen3_moe"):
        d["use_sliding_window"] = cfg.sliding_window is not None
        d["max_window_layers"] = cfg.num_hidden_layers
    if t == "qwen3_moe":
        d.update(
            num_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.expert_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            mlp_only_layers=list(cfg.mlp_only_layers or []),
            decoder_sparse_step=cfg.decoder_sparse_step,
        )
    if t == "gpt_oss":
        d.update(
            num_local_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            swiglu_alpha=cfg.swiglu_alpha,
            swiglu_limit=cfg.swiglu_limit,
        )
    if t in ("gemma2", "gemma3_text"):
        d.pop("hidden_act")
        d.update(
            hidden_activation=cfg.hidden_act,
            query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
            attn_logit_softcapping=cfg.attn_logit_softcapping,
            final_logit_softcapping=cfg.final_logit_softcapping,
        )
    if t == "gemma3_text":
        d.update(
            use_bidirectional_attention=False,
            rope_parameters={
                "full_attention": d["rope_parameters"],
                "sliding_attention": {"rope_theta": cfg.sliding_rope_theta or cfg.rope_theta, "rope_type": "default"},
            },
        )


def _deltanet_to_hf(cfg: ModelConfig, d: dict[str, Any]) -> None:
    """Qwen3.5 / Qwen3-Next keys as transformers 5.25's save_pretrained writes them."""
    d.update({k: getattr(cfg, k) for k in DELTANET_DEFAULTS if k != "partial_rotary_factor"})
    d["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    d.update(attention_bias=cfg.attention_bias, layer_types=list(cfg.layer_types))
    if cfg.model_type == "qwen3_5_text":
        return
    d.update(
        num_experts=cfg.num_local_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.expert_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size or 0,
    )
    if cfg.model_type == "qwen3_5_moe_text":
        d.pop("intermediate_size")  # (no dense MLP anywhere: transformers' config has no such key)
    else:
        d.update(
            norm_topk_prob=cfg.norm_topk_prob,
            mlp_only_layers=list(cfg.mlp_only_layers or []),
            decoder_sparse_step=cfg.decoder_sparse_step,
        )
