"""Model configuration shared by the trainer and the server.

Field names follow Hugging Face's Llama/Mistral/Qwen2/Mixtral configs so that a config.json
written by either side reads naturally in the other. Validation happens on construction, so a
bad config fails before any weights are built.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from baton.common.errors import UserError
from baton.common.families import (
    DELTANET_FAMILIES,
    FAMILY_FIELDS,
    NORM_TOPK_FAMILIES,
    apply_family_defaults,
    deltanet_parameters,
    mla_parameters,
    validate_family,
    validate_features,
)

MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "mixtral",
    "bamba",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
)
MODEL_TYPES += ("olmo2", "deepseek_v3", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's activation: SwiGLU or GeGLU (Gemma)
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")  # linear: a Gated DeltaNet mixer
BAMBA_FIELDS = (
    "attn_layer_indices",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_n_groups",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_expand",
    "mamba_chunk_size",
    "mamba_conv_bias",
    "mamba_proj_bias",
    "time_step_limit",
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ConfigError(UserError):
    """A configuration (a model's, a recipe's) that cannot describe a working model or run."""


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: same as num_attention_heads (MHA); 1 is MQA
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3", "factor": ...}
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = None  # Mistral-style window, in tokens (incl. the current one)
    layer_types: list[str] | None = None  # per layer "full_attention"/"sliding_attention"
    attention_bias: bool = False  # Llama semantics: bias on q, k, v and o projections
    qkv_bias: bool = False  # Qwen2 semantics: bias on q, k, v only
    tie_word_embeddings: bool = False
    num_local_experts: int = 0  # 0: dense SwiGLU MLP; >0: Mixtral-style top-k routed MoE
    num_experts_per_tok: int = 2
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    model_type: str | None = None  # None: inferred from the features (see infer_model_type)
    # Bamba (hybrid Mamba2 + attention; HF BambaConfig's names). Layers not in attn_layer_indices
    # hold a Mamba2 mixer (baton.common.ssm); meaningless for the other families, which omit them.
    attn_layer_indices: list[int] | None = None
    mamba_n_heads: int = 128
    mamba_d_head: int | None = None  # None (HF: "auto"): mamba_expand * hidden_size // mamba_n_heads
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: list[float] = field(default_factory=lambda: [0.0, float("inf")])
    # LayerSkip-trained exits (baton.train.early_exit): E = the output after the first E layers
    # through the final norm and LM head, which the server may draft or exit from.
    early_exit_layers: list[int] | None = None
    # --- the 2025-26 families (Qwen3, Qwen3-MoE, Gemma 3, gpt-oss, OLMo 2): each a feature, not a family
    qk_norm: str | None = None  # None, "head" or "full" (QK_NORMS)
    norm_layout: str = "pre"  # NORM_LAYOUTS
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + w): Gemma stores w around 0 (offset 1)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    query_pre_attn_scalar: float | None = None  # softmax scale query_pre_attn_scalar**-0.5 instead of head_dim**-0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    attention_sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss)
    sliding_rope_theta: float | None = None  # sliding layers' own rope base, unscaled (Gemma 3); None: rope_theta
    # MoE beyond Mixtral
    moe_intermediate_size: int | None = None  # an expert's width; None: intermediate_size
    norm_topk_prob: bool | None = None  # renormalise the top-k routing weights; None: the family's (Mixtral yes)
    mlp_only_layers: list[int] | None = None  # Qwen3-MoE: these layers keep a dense MLP
    decoder_sparse_step: int = 1  # Qwen3-MoE: layer i is sparse when (i + 1) % step == 0
    router_bias: bool = False  # gpt-oss: the router has a bias, softmax over the top-k logits
    expert_bias: bool = False  # gpt-oss: every expert projection has a bias
    swiglu_alpha: float | None = None  # gpt-oss's clamped SwiGLU: (up + 1) * g * sigmoid(alpha * g)
    swiglu_limit: float | None = None  # ... with g <= limit and |up| <= limit
    # DeepSeek-V3 (HF DeepseekV3Config's names; families.DEEPSEEK_FIELDS): multi-head latent attention
    # (common/mla.py), DeepSeekMoE (common/deepseek_moe.py) and the MTP modules (common/mtp.py)
    kv_lora_rank: int | None = None  # MLA's compressed KV width; None: no MLA
    q_lora_rank: int | None = None  # the low-rank query's width; None: one q_proj (DeepSeek-V2-Lite)
    qk_nope_head_dim: int = 0  # each head's query/key channels without rope
    qk_rope_head_dim: int = 0  # ... with rope (the key's shared by all heads)
    v_head_dim: int = 0
    rope_interleave: bool | None = None  # rope over pairs (x0, x1), (x2, x3)...; deepseek_v3's default True
    n_shared_experts: int = 0  # always-on experts, moe_intermediate_size * n each
    n_group: int = 1  # routed experts in n_group groups; a token picks from its topk_group best groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this
    first_k_dense_replace: int = 0  # layers below this keep a dense MLP (intermediate_size wide)
    num_nextn_predict_layers: int = 0  # MTP modules after the last layer (HF's num_mtp_layers)
    # Qwen3.5 / Qwen3-Next (HF's names; families.DELTANET_FIELDS): Gated DeltaNet mixers in the layers whose
    # layer_types entry is "linear_attention" (common/gated_deltanet.py), gated attention in the others
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int | None = None
    full_attention_interval: int | None = None  # a recipe's layer_types: layer i full when (i + 1) % it == 0
    partial_rotary_factor: float | None = None  # rope turns int(head_dim * factor) channels; None: all
    attn_output_gate: bool = False  # q_proj also emits a gate per head: o_proj(attn * sigmoid(gate))
    shared_expert_intermediate_size: int | None = None  # one always-on expert, its output times sigmoid(gate(x))
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # HF keys we carry through

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads > 0:  # (MLA: the rope width, as HF sets it)
            self.head_dim = (self.is_mla and self.qk_rope_head_dim) or self.hidden_size // self.num_attention_heads
        if self.model_type is None:
            self.model_type = self.infer_model_type()
        apply_family_defaults(self)
        if self.mamba_d_head is None and self.mamba_n_heads:
            self.mamba_d_head = self.mamba_expand * self.hidden_size // self.mamba_n_heads
        self.time_step_limit = [float(v) for v in self.time_step_limit]
        self.validate()

    # ----------------------------------------------------------------------------- validation
    def infer_model_type(self) -> str:
        """The HF family that can represent these features (used when exporting)."""
        if self.is_mla:
            return "deepseek_v3"
        if self.num_local_experts > 0:
            return "mixtral"
        if self.qkv_bias:
            return "qwen2"
        if self.sliding_window is not None:
            return "mistral"
        return "llama"

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"invalid model config: {msg}")

        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"{name} must be a positive integer, got {value!r}",
            )
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
            f"num_key_value_heads ({self.num_key_value_heads})",
        )
        rope = "qk_rope_head_dim" if self.is_mla else "head_dim"
        need(self.head_dim % 2 == 0, f"{rope} must be even for rotary embeddings, got {self.head_dim}")
        need(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")
        need(self.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        need(self.hidden_act in HIDDEN_ACTS, f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        need(self.torch_dtype in DTYPES, f"torch_dtype must be one of {sorted(DTYPES)}, got {self.torch_dtype!r}")
        need(self.model_type in MODEL_TYPES, f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.sliding_window is not None:
            need(
                isinstance(self.sliding_window, int) and self.sliding_window > 0,
                f"sliding_window must be a positive integer or null, got {self.sliding_window!r}",
            )
        if self.layer_types is not None:
            need(
                len(self.layer_types) == self.num_hidden_layers,
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
            )
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            need(not bad, f"layer_types entries must be in {LAYER_TYPES}, got {bad[0]!r}" if bad else "")
            need(
                self.sliding_window is not None or "sliding_attention" not in self.layer_types,
                "layer_types asks for sliding_attention but sliding_window is not set",
            )
        if self.num_local_experts > 0:
            need(
                0 < self.num_experts_per_tok <= self.num_local_experts,
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_local_experts "
                f"({self.num_local_experts})",
            )
        need(
            not (self.attention_bias and self.qkv_bias),
            "set attention_bias (Llama: q,k,v,o) or qkv_bias (Qwen2: q,k,v), not both",
        )
        e = self.early_exit_layers
        need(
            e is None
            or (e == sorted(set(e)) and all(isinstance(x, int) and 1 <= x < self.num_hidden_layers for x in e)),
            f"early_exit_layers must be sorted distinct layer counts in 1..{self.num_hidden_layers - 1}, got {e!r}",
        )
        self._validate_rope_scaling(need)
        validate_features(self, need)
        validate_family(self, need)
        if self.model_type == "bamba":
            self._validate_bamba(need)

    def _validate_rope_scaling(self, need) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        need(isinstance(rs, dict), f"rope_scaling must be a mapping, got {rs!r}")
        rope_type = rs.get("rope_type", rs.get("type", "default"))
        need(rope_type in ROPE_TYPES, f"rope_scaling type {rope_type!r} is not supported (use one of {ROPE_TYPES})")
        if rope_type in ("linear", "llama3"):
            need(float(rs.get("factor", 0)) > 0, "rope_scaling.factor must be positive")
        if rope_type == "yarn":
            need(float(rs.get("factor", 0)) > 0, "yarn rope_scaling.factor must be positive")
            known = {"rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
            known |= {"attention_factor", "truncate", "mscale", "mscale_all_dim"}
            unknown = sorted(set(rs) - known)
            need(not unknown, f"yarn rope_scaling key(s) {unknown} are not implemented")
        if rope_type == "llama3":
            for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                need(key in rs, f"llama3 rope_scaling needs {key!r}")
            need(
                rs["high_freq_factor"] > rs["low_freq_factor"],
                "llama3 rope_scaling needs high_freq_factor > low_freq_factor",
            )

    def _validate_bamba(self, need) -> None:
        """Shapes a Mamba2 mixer needs (HF BambaConfig.validate_architecture, and more)."""
        for name in ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        need(self.mamba_chunk_size > 0, f"mamba_chunk_size must be positive, got {self.mamba_chunk_size}")
        inner = self.mamba_expand * self.hidden_size
        need(
            self.mamba_d_head * self.mamba_n_heads == inner,
            f"mamba_d_head * mamba_n_heads ({self.mamba_d_head} * {self.mamba_n_heads}) must equal "
            f"mamba_expand * hidden_size ({inner})",
        )
        need(
            self.mamba_n_heads % self.mamba_n_groups == 0,
            f"mamba_n_heads ({self.mamba_n_heads}) must be divisible by mamba_n_groups ({self.mamba_n_groups})",
        )
        idx = self.attn_layer_indices or []
        need(
            all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in idx) and len(set(idx)) == len(idx),
            f"attn_layer_indices must be distinct layer indices in 0..{self.num_hidden_layers - 1}, got {idx}",
        )
        need(
            self.head_dim % 4 == 0,
            f"bamba rotates half of each head: head_dim must be a multiple of 4, got {self.head_dim}",
        )
        lo, hi = (self.time_step_limit + [None, None])[:2]
        need(
            len(self.time_step_limit) == 2 and 0 <= lo <= hi,
            f"time_step_limit must be [min, max], got {self.time_step_limit}",
        )
        need(self.sliding_window is None and self.layer_types is None, "bamba has no sliding-window attention")

    # ------------------------------------------------------------------------------ derived
    @property
    def is_hybrid(self) -> bool:
        """Some layers hold a recurrent mixer instead of attention (`mixer` says which)."""
        return self.mixer is not None

    @property
    def mixer(self) -> str | None:
        """The recurrent layers' kind: "mamba2" (Bamba, common/ssm.py), "gated_deltanet" (Qwen3.5,
        Qwen3-Next: common/gated_deltanet.py) or None (attention in every layer)."""
        if self.model_type == "bamba":
            return "mamba2"
        return "gated_deltanet" if self.model_type in DELTANET_FAMILIES else None

    def is_attention_layer(self, layer_idx: int) -> bool:
        """Attention, not a mixer, in this layer (MTP blocks, past the last layer, are attention)."""
        if self.mixer == "mamba2":
            return layer_idx in (self.attn_layer_indices or [])
        if self.mixer == "gated_deltanet" and layer_idx < self.num_hidden_layers:
            return self.layer_types[layer_idx] != "linear_attention"
        return True

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): the layers cache a latent, not per-head K/V."""
        return self.kv_lora_rank is not None

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (Bamba: the first half, HF's partial_rotary_factor 0.5;
        MLA: the qk_rope_head_dim channels of the query and the shared key)."""
        if self.is_mla:
            return self.qk_rope_head_dim
        if self.partial_rotary_factor is not None:
            return int(self.head_dim * self.partial_rotary_factor)
        return self.head_dim // 2 if self.model_type == "bamba" else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Routed experts in this layer (Qwen3-MoE may keep dense MLPs in some; DeepSeek-V3 its first
        first_k_dense_replace layers, but never its MTP blocks, layer_idx >= num_hidden_layers: HF's
        get_mtp_config sets first_k_dense_replace to 0 for them)."""
        if self.num_local_experts == 0 or layer_idx in (self.mlp_only_layers or []):
            return False
        if self.model_type == "deepseek_v3":
            return layer_idx >= min(self.first_k_dense_replace, self.num_hidden_layers)
        return (layer_idx + 1) % self.decoder_sparse_step == 0

    @property
    def moe_attribute(self) -> str:
        """The MoE block's checkpoint name in a decoder layer: Mixtral's `block_sparse_moe`, else `mlp`."""
        return "block_sparse_moe" if self.model_type == "mixtral" else "mlp"

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_sliding(self, layer_idx: int) -> bool:
        if self.sliding_window is None:
            return False
        if self.layer_types is None:
            return True
        return self.layer_types[layer_idx] == "sliding_attention"

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    def num_parameters(self) -> int:
        """Parameter count from the shapes alone (tied embeddings counted once)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        hq, hkv = self.num_attention_heads, self.num_key_value_heads
        attn = h * d * (hq * 2 + hkv * 2)
        if self.attention_bias:
            attn += d * (hq + 2 * hkv) + h
        if self.qkv_bias:
            attn += d * (hq + 2 * hkv)
        attn += {None: 0, "head": 2 * d, "full": (hq + hkv) * d}[self.qk_norm] + (hq if self.attention_sinks else 0)
        if self.attn_output_gate:  # q_proj's second half, the gate
            attn += hq * d * (h + self.attention_bias)
        if self.is_mla:
            attn = mla_parameters(self)
        e, ie = self.num_local_experts, self.expert_intermediate_size
        moe = e * 3 * h * ie + h * e + (e if self.router_bias else 0) + (e * (2 * ie + h) if self.expert_bias else 0)
        moe += 3 * h * ie * self.n_shared_experts
        if self.shared_expert_intermediate_size:  # the shared expert and its gate
            moe += 3 * h * self.shared_expert_intermediate_size + h
        layers = range(self.num_hidden_layers)
        ffn = sum(moe if self.is_moe_layer(j) else 3 * h * i for j in layers)
        norms = {"pre": 2, "sandwich": 4, "post": 2}[self.norm_layout] * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        n_attn = sum(self.is_attention_layer(j) for j in layers)
        mixers = (self.num_hidden_layers - n_attn) * self._mixer_parameters()
        # an MTP module: enorm, hnorm, eh_proj, a decoder block and shared_head.norm (embedding and head shared)
        mtp = 3 * h + 2 * h * h + attn + (moe if self.is_moe_layer(self.num_hidden_layers) else 3 * h * i) + norms
        body = n_attn * attn + mixers + ffn + self.num_hidden_layers * norms + embed + h
        return body + self.num_nextn_predict_layers * mtp

    def _mixer_parameters(self) -> int:
        if self.mixer == "gated_deltanet":
            return deltanet_parameters(self)
        inner, heads = self.mamba_expand * self.hidden_size, self.mamba_n_heads
        conv_dim = inner + 2 * self.mamba_n_groups * self.mamba_d_state
        proj = self.hidden_size * (inner + conv_dim + heads) + inner * self.hidden_size
        if self.mamba_proj_bias:
            proj += inner + conv_dim + heads + self.hidden_size
        conv = conv_dim * self.mamba_d_conv + (conv_dim if self.mamba_conv_bias else 0)
        return proj + conv + 3 * heads + inner  # + dt_bias, A_log, D, gated norm

    # ------------------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        """The fields; the Bamba-only ones only for bamba (other families' dicts stay as they were)."""
        d = dataclasses.asdict(self)
        d.pop("extra")
        if self.early_exit_layers is None:  # (dicts of models without exits stay as they were)
            d.pop("early_exit_layers")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in FAMILY_FIELDS:
            if d[name] == defaults[name] or (name == "norm_topk_prob" and self.model_type not in NORM_TOPK_FAMILIES):
                d.pop(name)
        if self.model_type != "bamba":
            for name in BAMBA_FIELDS:
                d.pop(name)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Strict: unknown keys are an error (they are usually typos in a recipe)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown model config key(s): {', '.join(unknown)}")
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))


PRESETS: dict[str, dict[str, Any]] = {
    # A few-minute CPU demo model.
    "demo": dict(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    # nanoGPT's CPU Shakespeare model size (4 layers, 4 heads, 128 dim).
    "nanogpt-cpu": dict(
        hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256
    ),
    "llama-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})
