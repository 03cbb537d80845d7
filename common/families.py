"""What each model family fixes, and the checks that keep a config one family's model.

ModelConfig (common/config.py) holds the features as plain fields; these tables say which values a
model_type implies, so that a recipe naming a family gets its features and one mixing families is
refused (the exported config.json would mean another model to transformers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

QK_NORMS = ("head", "full")  # RMSNorm of each head's q/k (Qwen3, Gemma 3) or of the whole q/k projection (OLMo 2)
NORM_LAYOUTS = ("pre", "sandwich", "post")  # Llama; Gemma (norms before and after each block); OLMo 2 (after)

# What each family fixes: a config of that model_type gets these values where it left the field at its
# default, and is refused where it set another (transformers would read the exported config.json as a
# different model). Every other family has the defaults of these fields.
FAMILY_FEATURES: dict[str, dict[str, Any]] = {
    "qwen3": {"qk_norm": "head"},
    "qwen3_moe": {"qk_norm": "head"},
    "gemma2": {
        "norm_layout": "sandwich",
        "norm_weight_offset": 1.0,
        "scale_embeddings": True,
        "hidden_act": "gelu_pytorch_tanh",
    },
    "gemma3_text": {
        "qk_norm": "head",
        "norm_layout": "sandwich",
        "norm_weight_offset": 1.0,
        "scale_embeddings": True,
        "hidden_act": "gelu_pytorch_tanh",
    },
    "gpt_oss": {"attention_sinks": True, "router_bias": True, "expert_bias": True},
    "olmo2": {"qk_norm": "full", "norm_layout": "post"},
}
# Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet mixers between gated attention layers, RMSNorms of (1 + w).
DELTANET_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
for _t in DELTANET_FAMILIES:
    FAMILY_FEATURES[_t] = {"qk_norm": "head", "norm_weight_offset": 1.0, "attn_output_gate": True}
STRUCTURAL = ("qk_norm", "norm_layout", "norm_weight_offset", "scale_embeddings", "hidden_act", "attention_sinks")
STRUCTURAL += ("router_bias", "expert_bias", "attn_output_gate")
GEMMA_FIELDS = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_rope_theta")
# Values a family's config may change, filled in where a config leaves them unset (None).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"norm_topk_prob": False},
    "gpt_oss": {"swiglu_alpha": 1.702, "swiglu_limit": 7.0},
    "deepseek_v3": {"rope_interleave": True},
}
# transformers' defaults for the DeltaNet families (what a config.json or recipe that leaves them out means)
DELTANET_DEFAULTS = dict(
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    partial_rotary_factor=0.25,
)
FAMILY_DEFAULTS.update({t: dict(DELTANET_DEFAULTS) for t in DELTANET_FAMILIES})
DELTANET_FIELDS = tuple(DELTANET_DEFAULTS) + (
    "full_attention_interval",
    "attn_output_gate",
    "shared_expert_intermediate_size",
)
# DeepSeek-V3's own fields (HF's names): every other family leaves them at their defaults ("off").
DEEPSEEK_FIELDS = (
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
)
# New-family fields, left out of to_dict() where at their defaults (older families' dicts stay as they were).
FAMILY_FIELDS = (
    "qk_norm",
    "norm_layout",
    "norm_weight_offset",
    "scale_embeddings",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "attention_sinks",
    "sliding_rope_theta",
    "moe_intermediate_size",
    "norm_topk_prob",
    "mlp_only_layers",
    "decoder_sparse_step",
    "router_bias",
    "expert_bias",
    "swiglu_alpha",
    "swiglu_limit",
) + DEEPSEEK_FIELDS
FAMILY_FIELDS += DELTANET_FIELDS
NORM_TOPK_FAMILIES = ("qwen3_moe", "deepseek_v3", "qwen3_next")  # the families whose config says whether to renormalise
MOE_WIDTH_FAMILIES = NORM_TOPK_FAMILIES + ("qwen3_5_moe_text",)  # ... whose experts have a width of their own
SPARSE_STEP_FAMILIES = ("qwen3_moe", "qwen3_next")  # mlp_only_layers and decoder_sparse_step


def apply_family_defaults(cfg) -> None:
    """`model_type: qwen3` in a recipe means Qwen3's q/k norms without spelling them out."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name, value in FAMILY_FEATURES.get(cfg.model_type, {}).items():
        if getattr(cfg, name) == defaults[name]:
            setattr(cfg, name, value)
    for name, value in FAMILY_DEFAULTS.get(cfg.model_type, {}).items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    if cfg.norm_topk_prob is None:
        cfg.norm_topk_prob = True
    if cfg.model_type in DELTANET_FAMILIES:
        step = cfg.full_attention_interval
        if cfg.layer_types is None and (step is None or (isinstance(step, int) and step > 0)):
            step = step or 4  # (HF's default: three DeltaNet layers, then one attention layer)
            kinds = ("linear_attention", "full_attention")
            cfg.layer_types = [kinds[(i + 1) % step == 0] for i in range(cfg.num_hidden_layers)]
            cfg.full_attention_interval = None  # (consumed: layer_types is the one truth from here on)
        if cfg.num_local_experts > 0 and cfg.shared_expert_intermediate_size is None:
            cfg.shared_expert_intermediate_size = 512


def validate_features(cfg, need) -> None:
    """Each new feature's own values (which family may use it is validate_family's)."""
    need(cfg.qk_norm in (None, *QK_NORMS), f"qk_norm must be null or one of {QK_NORMS}, got {cfg.qk_norm!r}")
    need(cfg.norm_layout in NORM_LAYOUTS, f"norm_layout must be one of {NORM_LAYOUTS}, got {cfg.norm_layout!r}")
    for name in (
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_rope_theta",
    ):
        value = getattr(cfg, name)
        need(value is None or value > 0, f"{name} must be positive or null, got {value!r}")
    m = cfg.moe_intermediate_size
    need(m is None or (isinstance(m, int) and m > 0), f"moe_intermediate_size must be a positive integer, got {m!r}")
    need(cfg.decoder_sparse_step >= 1, f"decoder_sparse_step must be >= 1, got {cfg.decoder_sparse_step}")
    dense = cfg.mlp_only_layers or []
    need(
        all(isinstance(i, int) and 0 <= i < cfg.num_hidden_layers for i in dense),
        f"mlp_only_layers must be layer indices in 0..{cfg.num_hidden_layers - 1}, got {dense}",
    )
    need(
        (cfg.swiglu_alpha is None) == (cfg.swiglu_limit is None),
        "swiglu_alpha and swiglu_limit come together (gpt-oss's clamped SwiGLU)",
    )


def validate_family(cfg, need) -> None:
    """The exported config.json must mean the same thing to transformers."""
    t = cfg.model_type
    moe_families = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_next", "qwen3_5_moe_text")
    need(
        t in moe_families or cfg.num_local_experts == 0,
        f"model_type {t!r} has no MoE; use one of {moe_families} for num_local_experts > 0",
    )
    need(
        t not in ("mixtral", "gpt_oss", "qwen3_5_moe_text") or cfg.num_local_experts > 0,
        f"model_type {t!r} needs num_local_experts > 0",
    )
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    fixed = FAMILY_FEATURES.get(t, {})
    for name in STRUCTURAL:
        want = fixed.get(name, defaults[name])
        need(getattr(cfg, name) == want, f"model_type {t!r} has {name}={want!r}, got {getattr(cfg, name)!r}")
    gemma = {
        "query_pre_attn_scalar": ("gemma2", "gemma3_text"),
        "final_logit_softcapping": ("gemma2", "gemma3_text"),
    }
    # (transformers' Gemma 3 reads attn_logit_softcapping but never applies it: only Gemma 2 has it)
    gemma.update(attn_logit_softcapping=("gemma2",), sliding_rope_theta=("gemma3_text",))
    for name, families in gemma.items():
        need(t in families or getattr(cfg, name) is None, f"{name} is {families}'s; model_type {t!r} has none")
    need(
        (t == "gpt_oss") == (cfg.swiglu_alpha is not None),
        f"the clamped SwiGLU (swiglu_alpha/limit) is gpt-oss's and only gpt-oss's, model_type {t!r}",
    )
    need(
        t in MOE_WIDTH_FAMILIES or cfg.moe_intermediate_size is None,
        f"moe_intermediate_size is {MOE_WIDTH_FAMILIES}'s; model_type {t!r} has none",
    )
    sparse = SPARSE_STEP_FAMILIES
    need(t in sparse or cfg.mlp_only_layers is None, f"mlp_only_layers is {sparse}'s; model_type {t!r} has none")
    need(t in sparse or cfg.decoder_sparse_step == 1, f"decoder_sparse_step is {sparse}'s; not {t!r}'s")
    need(
        t in NORM_TOPK_FAMILIES or cfg.norm_topk_prob,
        f"model_type {t!r} always renormalises the top-k routing weights (norm_topk_prob is {NORM_TOPK_FAMILIES}'s)",
    )
    if t == "deepseek_v3":
        validate_deepseek(cfg, need)
    else:
        for name in DEEPSEEK_FIELDS:
            need(getattr(cfg, name) == defaults[name], f"{name} is DeepSeek-V3's; model_type {t!r} has none")
    if t in DELTANET_FAMILIES:
        validate_deltanet(cfg, need)
    else:
        for name in DELTANET_FIELDS:
            need(getattr(cfg, name) == defaults[name], f"{name} is {DELTANET_FAMILIES}'s; model_type {t!r} has none")
    need(
        (t == "qwen2") == cfg.qkv_bias,
        "qkv_bias (bias on q,k,v only) is exactly Qwen2's: set both or neither of "
        f"qkv_bias and model_type 'qwen2' (got model_type {t!r}, qkv_bias {cfg.qkv_bias})",
    )
    need(
        t not in ("mistral", "qwen2", "mixtral") or not cfg.attention_bias,
        f"attention_bias (bias on o_proj too) is Llama's; model_type {t!r} cannot express it",
    )
    need(
        t == "bamba" or cfg.attn_layer_indices is None,
        f"attn_layer_indices picks Bamba's attention layers; model_type {t!r} has no other kind",
    )
    need(
        t not in ("llama", "olmo2") or cfg.sliding_window is None,
        f"model_type {t!r} has no sliding-window attention",
    )
    need(
        t in ("qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "gpt_oss") + DELTANET_FAMILIES
        or cfg.layer_types is None
        or set(cfg.layer_types) == {"sliding_attention"}
        or set(cfg.layer_types) == {"full_attention"},
        f"model_type {t!r} cannot express mixed layer_types",
    )


def validate_deepseek(cfg, need) -> None:
    """MLA's and DeepSeekMoE's shapes (what HF's DeepseekV3 modules need to build and route)."""

    def positive(name: str, optional: bool = False) -> None:
        v = getattr(cfg, name)
        ok = (optional and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v > 0)
        need(ok, f"deepseek_v3: {name} must be a positive integer{' or null' if optional else ''}, got {v!r}")

    need(cfg.kv_lora_rank is not None, "deepseek_v3 is multi-head latent attention: set kv_lora_rank")
    positive("kv_lora_rank")
    positive("q_lora_rank", optional=True)
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        positive(name)
    r = cfg.qk_rope_head_dim
    need(r % 2 == 0, f"deepseek_v3: qk_rope_head_dim must be even for rotary embeddings, got {r}")
    need(cfg.head_dim == r, f"deepseek_v3: head_dim is qk_rope_head_dim ({r}) as in HF's config, got {cfg.head_dim}")
    need(
        cfg.num_key_value_heads == cfg.num_attention_heads,
        f"deepseek_v3: num_key_value_heads ({cfg.num_key_value_heads}) must equal num_attention_heads "
        f"({cfg.num_attention_heads}): MLA decompresses a key and value for every head",
    )
    need(cfg.sliding_window is None and cfg.layer_types is None, "deepseek_v3 has no sliding-window attention")
    need(isinstance(cfg.rope_interleave, bool), f"rope_interleave must be true or false, got {cfg.rope_interleave!r}")
    for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
        v = getattr(cfg, name)
        need(isinstance(v, int) and v >= 0, f"deepseek_v3: {name} must be a non-negative integer, got {v!r}")
    e, n = cfg.num_local_experts, cfg.num_hidden_layers
    if e == 0:
        need(
            cfg.first_k_dense_replace >= n,
            f"deepseek_v3 has routed experts from layer first_k_dense_replace ({cfg.first_k_dense_replace}) on: "
            f"set num_local_experts > 0, or first_k_dense_replace >= num_hidden_layers ({n}) for a dense model",
        )
        return
    need(cfg.routed_scaling_factor > 0, f"routed_scaling_factor must be positive, got {cfg.routed_scaling_factor}")
    g, tg = cfg.n_group, cfg.topk_group
    need(isinstance(g, int) and g > 0, f"n_group must be a positive integer, got {g!r}")
    need(e % g == 0, f"num_local_experts (n_routed_experts, {e}) must be divisible by n_group ({g})")
    need(e // g >= 2, f"a group's score is its two best experts: n_routed_experts / n_group must be >= 2, got {e}/{g}")
    need(isinstance(tg, int) and 1 <= tg <= g, f"topk_group must be in 1..n_group ({g}), got {tg!r}")
    k = cfg.num_experts_per_tok
    need(
        k <= tg * (e // g),
        f"num_experts_per_tok ({k}) must be <= topk_group * experts per group ({tg} * {e // g}): "
        "a token's experts come from its topk_group groups",
    )


def mla_parameters(cfg) -> int:
    """One MLA layer's parameters (HF's DeepseekV3Attention; q_a/kv_a norms included)."""
    h, heads, kv, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q_out = heads * (cfg.qk_nope_head_dim + r)
    bias = cfg.attention_bias  # (HF: on q_a_proj, kv_a_proj_with_mqa and o_proj)
    q = h * q_out if cfg.q_lora_rank is None else (h + 1 + q_out + bias) * cfg.q_lora_rank
    kv_a = (h + bias) * (kv + r) + kv
    return q + kv_a + kv * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) + heads * cfg.v_head_dim * h + bias * h


def validate_deltanet(cfg, need) -> None:
    """The Gated DeltaNet families' shapes (what HF's Qwen3_5 / Qwen3Next modules need to build)."""
    t = cfg.model_type
    for name in tuple(DELTANET_DEFAULTS)[:5]:
        v = getattr(cfg, name)
        need(
            isinstance(v, int) and not isinstance(v, bool) and v > 0,
            f"{t}: {name} must be a positive integer, got {v!r}",
        )
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    need(
        hv % hk == 0,
        f"{t}: linear_num_value_heads ({hv}) must be divisible by linear_num_key_heads ({hk}): each query/key "
        "head serves a whole group of value heads",
    )
    step = cfg.full_attention_interval
    need(
        step is None,
        f"{t}: full_attention_interval must be a positive integer, got {step!r}"
        if not (isinstance(step, int) and step > 0)
        else f"{t}: give layer_types or full_attention_interval, not both",
    )
    kinds = ("linear_attention", "full_attention")
    bad = [k for k in cfg.layer_types if k not in kinds]
    need(not bad, f"{t}: layer_types entries must be in {kinds}, got {bad[0]!r}" if bad else "")
    need(cfg.sliding_window is None, f"{t} has no sliding-window attention (sliding_window must be null)")
    f, r = cfg.partial_rotary_factor, cfg.rotary_dim
    need(
        isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1,
        f"{t}: partial_rotary_factor must be in (0, 1], got {f!r}",
    )
    need(
        r >= 2 and r % 2 == 0,
        f"{t}: partial_rotary_factor {f} turns {r} of head_dim's {cfg.head_dim} channels: "
        "rotary embeddings need an even number of them",
    )
    shared = cfg.shared_expert_intermediate_size
    if cfg.num_local_experts > 0:
        need(
            isinstance(shared, int) and not isinstance(shared, bool) and shared > 0,
            f"{t}: shared_expert_intermediate_size must be a positive integer (every MoE layer has a gated "
            f"shared expert), got {shared!r}",
        )
    else:
        need(shared is None, f"{t}: shared_expert_intermediate_size is the MoE layers' shared expert: no experts here")


def deltanet_parameters(cfg) -> int:
    """One GatedDeltaNet layer's parameters (projections, conv, dt_bias, A_log, norm, out_proj)."""
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    key, value = cfg.linear_num_key_heads * cfg.linear_key_head_dim, hv * cfg.linear_value_head_dim
    conv = 2 * key + value
    return (
        h * (conv + value + 2 * hv) + conv * cfg.linear_conv_kernel_dim + 2 * hv + cfg.linear_value_head_dim + value * h
    )
