"""Structured pruning (LLM-Pruner style): score whole attention head groups and MLP channels by a
first-order importance estimate on calibration data, remove the least important, and write a
smaller *dense* checkpoint whose config says the new sizes, so any Llama loader (LLM, transformers)
reads it unchanged.

Importance of a group of weights is sum |w * dL/dw| over its elements (LLM-Pruner's element-wise
first-order Taylor term, sum-aggregated), with dL/dw the language-model loss gradient accumulated
over the calibration set. A head group is one KV head with the query heads that share it (plus
their o_proj columns): removing whole groups keeps GQA valid and shrinks the KV cache too. An MLP
channel is one row of gate_proj and up_proj and the matching column of down_proj. Every layer loses
the same number of each, because an HF config has one head count and one intermediate size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from baton.common.checkpoint import CheckpointError, HandoffMetadata, load_checkpoint, read_config, save_model
from baton.common.model import MLP, CausalLM
from baton.common.tokenizer import Tokenizer
from baton.serve.quantization.calibration import CalibrationConfig, calibration_tokens
from baton.serve.quantization.loader import quantization_config


@dataclass
class PruneConfig:
    heads: float = 0.0  # fraction of KV head groups removed per layer
    channels: float = 0.0  # fraction of MLP intermediate channels removed per layer
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("heads", "channels"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name} is a fraction to remove, in [0, 1); got {getattr(self, name)}")
        if self.heads == 0 and self.channels == 0:
            raise ValueError("nothing to prune: set a fraction of heads and/or channels to remove")


def num_removed(fraction: float, total: int, what: str) -> int:
    n = round(fraction * total)
    if fraction > 0 and n == 0:
        raise ValueError(
            f"removing {fraction:.0%} of {total} {what} rounds to none; the smallest step is {1 / total:.0%}"
        )
    return n


def importance(model: CausalLM, tokens: torch.Tensor, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(head-group scores [layers, kv_heads], channel scores [layers, intermediate]), higher = keep."""
    if any(not isinstance(getattr(layer, "ffn", None), MLP) for layer in model.model.layers):
        raise ValueError("structured pruning supports dense (non-MoE, non-hybrid) models")
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        for batch in tokens.split(batch_size):
            logits = model(batch[:, :-1])
            loss = (
                F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
                / tokens[:, 1:].numel()
            )
            loss.backward()
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    heads, channels = [], []
    for layer in model.model.layers:
        t = {n: (p.detach() * p.grad).abs() for n, p in layer.named_parameters() if p.grad is not None}
        q = t["self_attn.q_proj.weight"].reshape(cfg.num_key_value_heads, group * cfg.head_dim, -1).sum((1, 2))
        kv = sum(t[f"self_attn.{n}.weight"].reshape(cfg.num_key_value_heads, -1).sum(1) for n in ("k_proj", "v_proj"))
        o = t["self_attn.o_proj.weight"].reshape(cfg.hidden_size, cfg.num_key_value_heads, -1).sum((0, 2))
        heads.append(q + kv + o)
        channels.append(
            t["mlp.gate_proj.weight"].sum(1) + t["mlp.up_proj.weight"].sum(1) + t["mlp.down_proj.weight"].sum(0)
        )
    model.zero_grad(set_to_none=True)
    return torch.stack(heads), torch.stack(channels)


@torch.no_grad()
def prune_model(model: CausalLM, pcfg: PruneConfig, tokens: torch.Tensor) -> CausalLM:
    """A new, smaller CausalLM without the least important head groups and MLP channels."""
    cfg = model.config
    drop_groups = num_removed(pcfg.heads, cfg.num_key_value_heads, "KV head groups")
    drop_channels = num_removed(pcfg.channels, cfg.intermediate_size, "MLP channels")
    if drop_groups >= cfg.num_key_value_heads:
        raise ValueError("pruning would remove every attention head")
    head_scores, channel_scores = importance(model, tokens, pcfg.batch_size)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    kv_new = cfg.num_key_value_heads - drop_groups
    new_cfg = dataclasses.replace(
        cfg,
        num_key_value_heads=kv_new,
        num_attention_heads=kv_new * group,
        intermediate_size=cfg.intermediate_size - drop_channels,
        head_dim=cfg.head_dim,
    )
    state = model.checkpoint_state_dict()
    d = cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        keep_g = head_scores[i].topk(kv_new).indices.sort().values
        keep_c = channel_scores[i].topk(new_cfg.intermediate_size).indices.sort().values
        q_rows = (keep_g[:, None] * group * d + torch.arange(group * d)).reshape(-1)
        kv_rows = (keep_g[:, None] * d + torch.arange(d)).reshape(-1)
        p = f"model.layers.{i}."
        for name, rows, dim in (
            ("self_attn.q_proj", q_rows, 0),
            ("self_attn.k_proj", kv_rows, 0),
            ("self_attn.v_proj", kv_rows, 0),
            ("self_attn.o_proj", q_rows, 1),
            ("mlp.gate_proj", keep_c, 0),
            ("mlp.up_proj", keep_c, 0),
            ("mlp.down_proj", keep_c, 1),
        ):
            for suffix in ("weight", "bias"):
                key = f"{p}{name}.{suffix}"
                if key in state and not (suffix == "bias" and dim == 1):  # o_proj's bias is per output
                    state[key] = state[key].index_select(dim, rows).contiguous()
        # OLMo 2's q/k norms over the whole projection lose the pruned heads' channels too (per-head
        # norms, Qwen3's and Gemma 3's, are one head_dim vector shared by the heads: kept whole).
        if cfg.qk_norm == "full":
            for name, rows in (("q_norm", q_rows), ("k_norm", kv_rows)):
                key = f"{p}self_attn.{name}.weight"
                state[key] = state[key].index_select(0, rows).contiguous()
    pruned = CausalLM(new_cfg)
    pruned.load_state_dict(state, strict=not new_cfg.tie_word_embeddings)
    return pruned.to(device=next(model.parameters()).device, dtype=next(model.parameters()).dtype)


def prune_checkpoint(
    src: str | Path, out: str | Path, pcfg: PruneConfig, calib: CalibrationConfig | None = None
) -> Path:
    """`baton prune`: float handoff checkpoint -> smaller dense handoff checkpoint."""
    src, calib = Path(src), calib or CalibrationConfig(num_samples=32)
    if not src.is_dir():
        raise CheckpointError(f"checkpoint directory {src} does not exist")
    if quantization_config(src) is not None:
        raise ValueError(f"{src} is quantized; prune its float checkpoint (and quantize the result)")
    cfg = read_config(src)
    num_removed(pcfg.heads, cfg.num_key_value_heads, "KV head groups")
    num_removed(pcfg.channels, cfg.intermediate_size, "MLP channels")
    if not (src / "tokenizer.json").is_file():
        raise CheckpointError(f"{src} has no tokenizer.json: pruning needs one to tokenize calibration text")
    tokenizer = Tokenizer.from_dir(src)
    ckpt = load_checkpoint(src, dtype=torch.float32)
    pruned = prune_model(ckpt.model, pcfg, calibration_tokens(calib, tokenizer)).to(cfg.dtype)
    meta = HandoffMetadata(
        producer="baton prune",
        extra={"source": str(src.resolve()), "pruning": asdict(pcfg), "parameters_before": cfg.num_parameters()},
    )
    return save_model(out, pruned, tokenizer_dir=src, metadata=meta)
