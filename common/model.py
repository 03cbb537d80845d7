"""The one model definition: a plain PyTorch Llama-family decoder.

Covers Llama (GQA/MQA, llama3 rope scaling, optional attention bias), Mistral (sliding window),
Qwen2 (q/k/v bias), Mixtral (top-k routed SwiGLU experts) and the hybrid Bamba (Mamba2 mixers,
baton.common.ssm, in the layers that hold no attention). Parameter names equal the Hugging
Face checkpoint names, so a state dict is a checkpoint and vice versa.

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
from baton.common.moe import MoE
from baton.common.rope import inv_frequencies, rotary_cos_sin
from baton.common.ssm import Mamba2Mixer
from baton.kernels import apply_rotary, rms_norm, swiglu
from torch import nn


class AttentionBackend(Protocol):
    """Computes softmax(q k^T * scale + mask) v for one layer.

    q: [B, S, Hq, D], k and v: [B, S, Hkv, D], already rotated; returns [B, S, Hq, D].
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
        if window is None or window >= s:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scaling, enable_gqa=True)
        else:
            i = torch.arange(s, device=q.device)
            dist = i[:, None] - i[None, :]
            mask = (dist >= 0) & (dist < window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
        return out.transpose(1, 2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual) in one fused pass."""
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scaling = self.head_dim**-0.5
        self.rotary_dim = cfg.rotary_dim
        self.sliding_window = cfg.sliding_window if cfg.is_sliding(layer_idx) else None
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
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
            q = torch.cat([qr.view(b, s, self.num_heads, r), q[..., r:]], dim=-1)
            k = torch.cat([kr.view(b, s, self.num_kv_heads, r), k[..., r:]], dim=-1)
        out = attn(q.view(b, s, self.num_heads, -1), k.view(b, s, self.num_kv_heads, -1), v, self)
        return self.o_proj(out.reshape(b, -1, self.num_heads * self.head_dim))  # -1: the rows answered


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    # Set by fuse_residual_norms(): the residual add runs inside the post-attention norm's kernel.
    # Off by default because tensor parallelism's sequence-parallel plan treats a norm as a
    # one-tensor module; the server, which runs no such plan, turns it on.
    fuse_residual_norm: bool = False

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        if cfg.num_local_experts > 0:
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        if a.shape[1] != x.shape[1]:  # the backend answered only its query_rows (a server's last layer)
            x = x[:, attn.query_rows]
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        if self.fuse_residual_norm:  # the same sums, one read and write of the hidden states fewer
            h, x = self.post_attention_layernorm(a, residual=x)
            return x + ffn(h)
        x = x + a
        return x + ffn(self.post_attention_layernorm(x))


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
        layer = HybridDecoderLayer if cfg.is_hybrid else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_hidden_layers))
        if cfg.is_hybrid:  # Bamba's checkpoint name for the final norm
            self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        else:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A plain float32 attribute, not a buffer: model.to(bfloat16) must not round frequencies.
        self.inv_freq = inv_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)

    @property
    def final_norm(self) -> RMSNorm:
        return self.final_layernorm if hasattr(self, "final_layernorm") else self.norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        x = self.embed_tokens(input_ids)
        return self.final_norm(run_layers(self.layers, x, positions, self.inv_freq, attn))


def fuse_residual_norms(model: nn.Module) -> nn.Module:
    """Every decoder layer adds its attention residual inside the post-attention RMSNorm kernel
    (kernels/rmsnorm.py). Outputs are unchanged: x + a is the same sum either way."""
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
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

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, attn: AttentionBackend | None = None
    ) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        return self.model(input_ids, positions, attn or DenseCausalAttention())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, attn: AttentionBackend | None = None
    ) -> torch.Tensor:
        """input_ids [B, S] -> logits [B, S, vocab]."""
        return self.compute_logits(self.hidden(input_ids, positions, attn))

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict as written to disk: a tied LM head is stored once, as HF does."""
        sd = self.state_dict()
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd


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
                module.weight.fill_(1.0)
            elif isinstance(module, Mamba2Mixer):
                module.reset_ssm_parameters()
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
