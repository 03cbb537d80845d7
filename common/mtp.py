"""DeepSeek-V3's multi-token-prediction (MTP) modules (arXiv 2412.19437 section 2.2).

Module k (0-based) predicts the token k + 2 ahead of each position: it mixes the previous depth's
hidden state at position i (depth 0: the main model's, after its final norm) with the embedding of
token i + k + 1, runs one decoder block over the sequence, and shares the main model's LM head:

    h'_i = block(eh_proj([enorm(embed(t_{i+k+1})); hnorm(h_i)]))     logits_i = head(shared_head.norm(h'_i))

and shared_head.norm(h'_i) is the hidden state depth k + 1 takes (as transformers' MtpLayer and
vLLM/SGLang recycle it). Checkpoints keep module k as the layer after the last,
`model.layers.{num_hidden_layers + k}.`: enorm, hnorm, eh_proj, shared_head.norm, the block's own
names directly under the prefix (self_attn.*, mlp.*, input_layernorm, post_attention_layernorm),
and optionally copies of the embedding (embed_tokens) and LM head (shared_head.head). Baton holds
them as `CausalLM.mtp[k]` (block under `.block`); `checkpoint_name`/`module_name` translate, and
any loader that reads tensors by parameter name goes through them. The copies are held only where
a checkpoint's differ from the main model's (checkpoint.load_checkpoint), so the model needs no
second embedding and head in memory.

This module sits below common/model.py, which builds the blocks and norms and hands them in.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from baton.common.config import ModelConfig
from baton.common.rope import rotary_cos_sin
from torch import nn

# Names directly under an MTP module's checkpoint prefix that are its own, not its block's.
OWN_NAMES = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
# The optional copies of the main model's embedding and head a checkpoint may carry per module.
COPY_NAMES = ("embed_tokens.weight", "shared_head.head.weight")
_MODULE = re.compile(r"^mtp\.(\d+)\.(.*)$")
_CHECKPOINT = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


class SharedHead(nn.Module):
    """shared_head: its norm, and a head of its own only where a checkpoint's copy differs from lm_head."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.head: nn.Linear | None = None


class MTPLayer(nn.Module):
    """One MTP module: enorm, hnorm, eh_proj (Linear 2H -> H), block (a DecoderLayer, built by
    common/model.py at layer index num_hidden_layers + index), shared_head."""

    def __init__(self, cfg: ModelConfig, index: int, block: nn.Module, norm: Callable[[int, float], nn.Module]):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.index, self.layer_idx = index, cfg.num_hidden_layers + index
        self.enorm = norm(h, eps)
        self.hnorm = norm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = block
        self.shared_head = SharedHead(norm(h, eps))
        self.embed_tokens: nn.Embedding | None = None  # (a checkpoint's own copy, where it differs)
        self.vocab_size = cfg.vocab_size

    def add_copy(self, name: str) -> None:
        """Hold a copy of the embedding or head of our own (`name` in COPY_NAMES), for a checkpoint
        whose copy differs from the main model's; built on the current device (meta, for loading)."""
        h = self.eh_proj.out_features
        if name == "embed_tokens.weight":
            self.embed_tokens = nn.Embedding(self.vocab_size, h)
        elif name == "shared_head.head.weight":
            self.shared_head.head = nn.Linear(h, self.vocab_size, bias=False)
        else:
            raise ValueError(f"{name!r} is not one of an MTP module's copies {COPY_NAMES}")

    def forward(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        attn,
        embed: Callable[[torch.Tensor], torch.Tensor],
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [B, S, H]: the previous depth's hidden state per row (depth 0: the main model's
        output after its final norm; depth k > 0: `norm_output` of depth k - 1); next_ids [B, S]: the
        token one past the hidden's (token i + 1 for row i at depth 0); positions [B, S]: the rows'
        rope positions (those of `hidden`, as vLLM: only their differences matter); attn: the backend
        (layer_idx num_hidden_layers + index); embed: the main model's token embedding (the module's
        own copy is used where it has one); inv_freq: the main model's (DecoderModel.inv_freq).
        Returns the block's output h' [B, S', H] before shared_head.norm (S' as the backend answers)."""
        e = (self.embed_tokens if self.embed_tokens is not None else embed)(next_ids)
        cos, sin = rotary_cos_sin(inv_freq, positions, hidden.dtype)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        return self.block(x, cos, sin, attn)

    def norm_output(self, h: torch.Tensor) -> torch.Tensor:
        """shared_head.norm(h'): the head's input, and the hidden state the next depth takes."""
        return self.shared_head.norm(h)

    def logits(self, h: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """h' -> logits: shared_head.norm, then the module's own head or else the main `lm_head`."""
        head = self.shared_head.head if self.shared_head.head is not None else lm_head
        return head(self.norm_output(h))


def checkpoint_name(name: str, num_hidden_layers: int) -> str:
    """A parameter's name in checkpoints: `mtp.{k}.block.X` and `mtp.{k}.Y` are
    `model.layers.{num_hidden_layers + k}.X` / `.Y`; every other name is unchanged."""
    m = _MODULE.match(name)
    if m is None:
        return name
    return f"model.layers.{num_hidden_layers + int(m[1])}.{m[2].removeprefix('block.')}"


def module_name(name: str, num_hidden_layers: int) -> str:
    """The inverse of checkpoint_name: a checkpoint tensor's parameter name in CausalLM."""
    m = _CHECKPOINT.match(name)
    if m is None or int(m[1]) < num_hidden_layers:
        return name
    rest = m[2] if m[2].split(".", 1)[0] in OWN_NAMES else f"block.{m[2]}"
    return f"mtp.{int(m[1]) - num_hidden_layers}.{rest}"


def mtp_layer_of(name: str, num_hidden_layers: int) -> int | None:
    """k where checkpoint tensor `name` belongs to MTP module k, else None."""
    m = _CHECKPOINT.match(name)
    return int(m[1]) - num_hidden_layers if m is not None and int(m[1]) >= num_hidden_layers else None
