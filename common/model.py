"""The one model definition: a plain PyTorch Llama-family decoder.

Covers Llama (GQA/MQA, llama3 rope scaling, optional attention bias), Mistral (sliding window),
Qwen2 (q/k/v bias), Mixtral (top-k routed SwiGLU experts), the hybrid Bamba (Mamba2 mixers,
baton.common.ssm, in the layers that hold no attention), the 2025-26 families (common/families.py),
DeepSeek-V3 (latent attention, common/mla.py; its MTP modules, common/mtp.py) and the Qwen3.5 /
Qwen3-Next hybrids (Gated DeltaNet mixers, common/gated_deltanet.py, between gated attention layers).
Parameter names equal the Hugging Face checkpoint names, so a state dict is a checkpoint and vice versa.

The model never decides how attention is computed: the attention core (scores, softmax, ·V) is a
backend passed to forward, the way vLLM and nano-vllm pass attention metadata. Training uses
`DenseCausalAttention`; the server passes a paged backend that also writes the KV cache. Parallelism,
recomputation and quantization are applied from outside (torchtitan style) and never live here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from baton.common.config import ModelConfig
from baton.common.deepseek_moe import DeepSeekMoE
from baton.common.gated_deltanet import GatedDeltaNet
from baton.common.mla import MLAttention
from baton.common.moe import GptOssExperts, build_moe
from baton.common.mtp import MTPLayer, checkpoint_name
from baton.common.rope import attention_factor, inv_frequencies, rotary_cos_sin
from baton.common.ssm import Mamba2Mixer
from baton.kernels import apply_rotary, rms_norm, swiglu
from baton.kernels.attention_torch import attention_math
from torch import nn


class AttentionBackend(Protocol):
    """Computes softmax(q k^T * scale + mask) v for one layer.

    q: [B, S, Hq, D], k: [B, S, Hkv, D], v: [B, S, Hkv, Dv], already rotated; returns [B, S, Hq, Dv]
    (Dv = D but for MLA's naive form, whose values are v_head_dim wide).
    `layer` gives layer_idx, scaling and sliding_window. A serving backend packs all sequences
    of a step into B=1 and reads its own metadata (block tables, slot mapping) set per step. It
    may answer only some rows (the ones a server samples, at the last layer: the others' outputs
    would feed nothing): then it returns [1, len(query_rows), Hq, D] and its `query_rows` names them.
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "Attention") -> torch.Tensor: ...


class DenseCausalAttention:
    """Causal (optionally sliding-window) attention over whole sequences, no cache."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "Attention") -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA layout [B, H, S, D]
        window, s = layer.sliding_window, q.shape[2]
        mask = None
        if window is not None and window < s:
            i = torch.arange(s, device=q.device)
            dist = i[:, None] - i[None, :]
            mask = (dist >= 0) & (dist < window)
        sinks, cap = getattr(layer, "sinks", None), getattr(layer, "logit_softcap", None)
        if sinks is not None or cap:
            if mask is None:
                mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            out = attention_math(q, k, v, layer.scaling, mask, sinks, cap or 0.0)  # what SDPA cannot express
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scaling, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
        return out.transpose(1, 2)


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + w). Gemma keeps w around 0 with offset 1 (its checkpoints' weights)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual) in one fused pass."""
        if not self.offset:
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (self.offset + self.weight.float())
        return out.to(x.dtype) if residual is None else (out.to(x.dtype), x)


class Attention(nn.Module):
    """Grouped-query attention with the options of every family Baton reads: q/k RMSNorm per head or
    over the whole projection, a softmax scale of its own, soft-capped scores, learned sinks, a
    sliding window, a rope of its own per layer type, partial rotary and an output gate (Qwen3.5 /
    Qwen3-Next: q_proj emits each head's query then its gate, and the output is attn * sigmoid(gate)
    before o_proj). The attention core is the backend's."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.rotary_dim = cfg.rotary_dim
        # YaRN's factor on cos/sin reaches only the rotated channels: with all of them rotated it folds
        # into the softmax scale (squared), with some it multiplies the rotated part of q and k.
        factor = attention_factor(cfg.rope_scaling)
        self.rope_factor = factor if self.rotary_dim < self.head_dim else 1.0
        self.scaling = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5 * (factor / self.rope_factor) ** 2
        self.sliding_window = cfg.sliding_window if cfg.is_sliding(layer_idx) else None
        # Row of the model's inv_freq this layer rotates with, where sliding layers have a rope of their own.
        self.rope_index = int(cfg.is_sliding(layer_idx)) if cfg.sliding_rope_theta is not None else None
        self.logit_softcap = cfg.attn_logit_softcapping
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        h, d = cfg.hidden_size, self.head_dim
        self.output_gate = cfg.attn_output_gate
        self.q_proj = nn.Linear(h, self.num_heads * d * (2 if self.output_gate else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=cfg.attention_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm is not None:  # "head": one norm of head_dim shared by the heads; "full": the whole width
            full = cfg.qk_norm == "full"
            eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
            self.q_norm = RMSNorm(self.num_heads * d if full else d, eps, offset)
            self.k_norm = RMSNorm(self.num_kv_heads * d if full else d, eps, offset)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attention_sinks else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [B, S, width] (serve/runner/fusion.py does it in one GEMM)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.project(x)
        gate = None
        if self.output_gate:  # per head [query (head_dim), gate (head_dim)]
            q, gate = q.view(b, s, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_index is not None:
            cos, sin = cos[..., self.rope_index, :], sin[..., self.rope_index, :]
        t = b * s
        if self.rotary_dim == self.head_dim:
            q, k = apply_rotary(
                q.reshape(t, self.num_heads, -1),
                k.reshape(t, self.num_kv_heads, -1),
                cos.reshape(t, -1),
                sin.reshape(t, -1),
            )
        else:  # partial rotary (Bamba): the first rotary_dim channels turn, the rest pass through
            r = self.rotary_dim
            qr, kr = apply_rotary(
                q[..., :r].reshape(t, self.num_heads, r),
                k[..., :r].reshape(t, self.num_kv_heads, r),
                cos.reshape(t, -1),
                sin.reshape(t, -1),
            )
            if self.rope_factor != 1.0:
                qr, kr = qr * self.rope_factor, kr * self.rope_factor
            q = torch.cat([qr.view(b, s, self.num_heads, r), q[..., r:]], dim=-1)
            k = torch.cat([kr.view(b, s, self.num_kv_heads, r), k[..., r:]], dim=-1)
        out = attn(q.view(b, s, self.num_heads, -1), k.view(b, s, self.num_kv_heads, -1), v, self)
        out = out.reshape(b, -1, self.num_heads * self.head_dim)  # -1: the rows answered
        if gate is not None:
            gate = gate.reshape(b, s, -1)
            if out.shape[1] != s:
                gate = gate[:, attn.query_rows]
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), SwiGLU (silu) or GeGLU (Gemma's tanh gelu)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = act

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.act == "silu":
            return swiglu(gate, up)
        return F.gelu(gate, approximate="tanh") * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Attention then a feed-forward block (a gated MLP or routed experts), each with a residual, and
    RMSNorms where the family puts them (cfg.norm_layout): "pre" (Llama: before each block, the
    post_attention_layernorm being the one before the MLP), "sandwich" (Gemma 3: before and after
    each) or "post" (OLMo 2: after each, on the block's output)."""

    # Set by fuse_residual_norms(): the residual add runs inside the post-attention norm's kernel.
    # Off by default because tensor parallelism's sequence-parallel plan treats a norm as a
    # one-tensor module; the server, which runs no such plan, turns it on.
    fuse_residual_norm: bool = False

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        if not cfg.is_attention_layer(layer_idx):  # a Gated DeltaNet layer (Qwen3.5, Qwen3-Next)
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = MLAttention(cfg, layer_idx, RMSNorm) if cfg.is_mla else Attention(cfg, layer_idx)
        self.ffn_name = cfg.moe_attribute if cfg.is_moe_layer(layer_idx) else "mlp"
        if cfg.is_moe_layer(layer_idx):  # (DeepSeekMoE subclasses moe.MoE, so build_moe cannot make it)
            setattr(self, self.ffn_name, DeepSeekMoE(cfg) if cfg.model_type == "deepseek_v3" else build_moe(cfg))
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.norm_layout = cfg.norm_layout
        h, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset
        if cfg.norm_layout != "post":
            self.input_layernorm = RMSNorm(h, eps, offset)
        self.post_attention_layernorm = RMSNorm(h, eps, offset)
        if cfg.norm_layout == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(h, eps, offset)
        if cfg.norm_layout != "pre":
            self.post_feedforward_layernorm = RMSNorm(h, eps, offset)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_name)

    def token_mixer(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend):
        """Attention, or the layer's Gated DeltaNet: run by a backend that carries recurrent state
        (its `mix`, as for Bamba's mixers), else over whole sequences from a zero state (training)."""
        mixer = self._modules.get("linear_attn")
        if mixer is None:
            return self.self_attn(h, cos, sin, attn)
        mix = getattr(attn, "mix", None)
        return mixer(h)[0] if mix is None else mix(mixer, h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        post = self.norm_layout == "post"
        a = self.token_mixer(x if post else self.input_layernorm(x), cos, sin, attn)
        if a.shape[1] != x.shape[1]:  # the backend answered only its query_rows (a server's last layer)
            x = x[:, attn.query_rows]
        if self.norm_layout != "pre":
            x = x + self.post_attention_layernorm(a)
            h = x if post else self.pre_feedforward_layernorm(x)
            return x + self.post_feedforward_layernorm(self.ffn(h))
        if self.fuse_residual_norm:  # the same sums, one read and write of the hidden states fewer
            h, x = self.post_attention_layernorm(a, residual=x)
            return x + self.ffn(h)
        x = x + a
        return x + self.ffn(self.post_attention_layernorm(x))


class HybridDecoderLayer(nn.Module):
    """A Bamba layer: a Mamba2 mixer (`mamba`) or attention (`self_attn`, in attn_layer_indices),
    then the SwiGLU `feed_forward`; HF's names, so the handoff loads in BambaForCausalLM."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        if cfg.is_attention_layer(layer_idx):
            self.self_attn = Attention(cfg, layer_idx)
        else:
            self.mamba = Mamba2Mixer(cfg, layer_idx)
        self.feed_forward = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "mamba"):  # a backend that carries recurrent state (HybridCache) runs the mixer
            mix = getattr(attn, "mix", None)
            x = x + (self.mamba(h) if mix is None else mix(self.mamba, h))
        else:
            x = x + self.self_attn(h, cos, sin, attn)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size**0.5 if cfg.scale_embeddings else None
        bamba = cfg.model_type == "bamba"
        layer = HybridDecoderLayer if bamba else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_hidden_layers))
        if bamba:  # Bamba's checkpoint name for the final norm
            self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        else:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)
        # A plain float32 attribute, not a buffer: model.to(bfloat16) must not round frequencies.
        self.inv_freq = inv_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        if cfg.sliding_rope_theta is not None:  # Gemma 3: row 1 for the sliding layers (Attention.rope_index)
            self.inv_freq = torch.stack([self.inv_freq, inv_frequencies(cfg.rotary_dim, cfg.sliding_rope_theta)])

    @property
    def final_norm(self) -> RMSNorm:
        return self.final_layernorm if hasattr(self, "final_layernorm") else self.norm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # Gemma: the factor rounded to the activations' dtype, as HF does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        x = self.embed(input_ids)
        return self.final_norm(run_layers(self.layers, x, positions, self.inv_freq, attn))


def fuse_residual_norms(model: nn.Module) -> nn.Module:
    """Every pre-norm decoder layer adds its attention residual inside the post-attention RMSNorm
    kernel (kernels/rmsnorm.py). Outputs are unchanged: x + a is the same sum either way."""
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and layer.norm_layout == "pre":
            layer.fuse_residual_norm = True
    return model


def run_layers(
    layers: Iterable[DecoderLayer],
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attn: AttentionBackend,
) -> torch.Tensor:
    """Hidden states x through decoder `layers`, rotated for `positions`: the decoder's body, also
    run by a pipeline stage that holds some of the layers."""
    cos, sin = rotary_cos_sin(inv_freq, positions, x.dtype)
    for layer in layers:
        x = layer(x, cos, sin, attn)
    return x


class CausalLM(nn.Module):
    """Decoder + LM head. `hidden` and `compute_logits` are split so that a server computes
    logits only where it samples and Medusa heads can read the last hidden state."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        n = cfg.num_hidden_layers  # DeepSeek-V3's MTP modules, each block the layer after the last
        mtp = [MTPLayer(cfg, k, DecoderLayer(cfg, n + k), RMSNorm) for k in range(cfg.num_nextn_predict_layers)]
        self.mtp = nn.ModuleList(mtp) if mtp else None

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, attn: AttentionBackend | None = None
    ) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        return self.model(input_ids, positions, attn or DenseCausalAttention())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(hidden), self.config.final_logit_softcapping)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, attn: AttentionBackend | None = None
    ) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, vocab]."""
        return self.compute_logits(self.hidden(input_ids, positions, attn))

    def mtp_hidden(
        self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """The MTP modules over whole sequences with dense causal attention (training's reference).

        input_ids [B, S]; hidden: the main model's `self.hidden(input_ids, positions)` where the caller
        has it already (computed here otherwise); positions [B, S] as for `hidden`. Returns, for
        module k = 1..D, shared_head.norm of its output, [B, S - k, H]: row i has seen tokens 0..i+k
        and is the head's input for token i + k + 1, so `lm_head(out[k-1])[:, :-1]` pairs with labels
        `input_ids[:, k + 1:]` (the last row predicts past the input: a drafter's row)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP modules (config num_nextn_predict_layers is 0)")
        s = input_ids.shape[-1]
        if positions is None:
            positions = torch.arange(s, device=input_ids.device).expand_as(input_ids)
        h = self.hidden(input_ids, positions) if hidden is None else hidden
        attn, out = DenseCausalAttention(), []
        for k, layer in enumerate(self.mtp, 1):
            rows = slice(0, s - k)
            h = layer(h[:, rows], input_ids[:, k:], positions[:, rows], attn, self.model.embed, self.model.inv_freq)
            h = layer.norm_output(h)
            out.append(h)
        return out

    def mtp_logits(
        self, input_ids: torch.Tensor, hidden: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """mtp_hidden through each module's head (its own copy, else lm_head): [B, S - k, vocab] for
        k = 1..D, row i predicting token i + k + 1."""
        normed = self.mtp_hidden(input_ids, hidden, positions)
        heads = [m.shared_head.head if m.shared_head.head is not None else self.lm_head for m in self.mtp]
        return [head(h) for head, h in zip(heads, normed)]

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict as written to disk: a tied LM head is stored once, as HF does; MTP module k
        under model.layers.{num_hidden_layers + k} (mtp.checkpoint_name)."""
        sd = self.state_dict()
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        if self.mtp is not None:
            sd = {checkpoint_name(k, self.config.num_hidden_layers): v for k, v in sd.items()}
        return sd


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma's final-logit soft-capping); logits unchanged without a cap."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def init_weights(model: CausalLM, seed: int | None = None) -> CausalLM:
    """Llama-style init: normal(0, initializer_range) for matrices (and convolutions), ones for
    norms, zero biases; Mamba2's own init for the SSM parameters."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    std = model.config.initializer_range
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
                w = torch.empty(module.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                module.weight.copy_(w)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0 - module.offset)
            elif isinstance(module, Mamba2Mixer):
                module.reset_ssm_parameters()
            elif isinstance(module, GatedDeltaNet):
                module.reset_parameters(gen)
            elif isinstance(module, GptOssExperts):  # (stacked expert tensors, not nn.Linear)
                module.reset_parameters(std, gen)
    return model


def build_model(
    cfg: ModelConfig, seed: int | None = 0, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> CausalLM:
    """A freshly initialised model in cfg's dtype (or `dtype`)."""
    model = init_weights(CausalLM(cfg), seed)
    return model.to(device=device, dtype=dtype or cfg.dtype)


@torch.no_grad()
def greedy_generate(model: CausalLM, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Reference greedy decoding without a KV cache (re-runs the whole prefix each step).
    Slow by design: it is the independent yardstick the serving engine is checked against."""
    ids = prompt
    for _ in range(max_new_tokens):
        next_id = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=-1)
    return ids[:, prompt.shape[-1] :]
