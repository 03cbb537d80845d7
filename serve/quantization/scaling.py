"""Per-input-channel rescaling that leaves the float model unchanged (shared by AWQ and SmoothQuant).

For linears that read the output of one preceding op, y = W x = (W diag(s)) (x / s): the 1/s is
folded into that op (an RMSNorm's weight, or the rows of a preceding linear) and the linears
multiply their columns by s. The float function is identical; only what gets quantized changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from baton.common.model import MLP, DecoderLayer, RMSNorm
from baton.serve.quantization.calibration import CalibrationError
from torch import nn


@dataclass
class ScaleGroup:
    prev: nn.Module  # RMSNorm or nn.Linear whose output is the linears' input
    linears: dict[str, nn.Linear]  # names relative to the decoder layer


def scale_groups(layer: DecoderLayer) -> list[ScaleGroup]:
    """Llama's four places (as in AutoAWQ / llm-compressor): norm -> q,k,v; v -> o (when every
    head has its own v, so a v channel feeds exactly one o input); norm -> gate,up; up -> down.
    The norms are the ones before each block: the input norm, and the post-attention norm ("pre",
    Llama) or the pre-feed-forward one ("sandwich", Gemma). OLMo 2's norms ("post") sit after the
    blocks, so q,k,v and gate,up read the bare residual stream and have no group (quantized unscaled);
    q/k norms come after q/k's outputs and change nothing here."""
    if not isinstance(layer.ffn, MLP):
        raise CalibrationError("AWQ and SmoothQuant support dense (non-MoE) models; use gptq or rtn for MoE models")
    a, m = layer.self_attn, layer.ffn
    pre_attn = getattr(layer, "input_layernorm", None)
    pre_ffn = {"pre": layer.post_attention_layernorm, "sandwich": getattr(layer, "pre_feedforward_layernorm", None)}
    pre_ffn = pre_ffn.get(layer.norm_layout)
    groups = []
    if pre_attn is not None:
        groups.append(ScaleGroup(pre_attn, {f"self_attn.{n}": getattr(a, n) for n in ("q_proj", "k_proj", "v_proj")}))
    if a.v_proj.out_features == a.o_proj.in_features:
        groups.append(ScaleGroup(a.v_proj, {"self_attn.o_proj": a.o_proj}))
    if pre_ffn is not None:
        groups.append(ScaleGroup(pre_ffn, {"mlp.gate_proj": m.gate_proj, "mlp.up_proj": m.up_proj}))
    groups.append(ScaleGroup(m.up_proj, {"mlp.down_proj": m.down_proj}))
    return groups


@torch.no_grad()
def fold_scales(group: ScaleGroup, s: torch.Tensor) -> None:
    """Divide the preceding op's output by s and multiply the linears' input columns by s. An
    RMSNorm multiplies by (offset + w) (Gemma's offset 1): that whole factor is divided."""
    prev = group.prev
    if isinstance(prev, RMSNorm) and prev.offset:
        w = prev.weight
        w.copy_(((prev.offset + w.float()) / s.float() - prev.offset).to(w.dtype))
    elif isinstance(prev, RMSNorm):
        prev.weight.div_(s.to(prev.weight.dtype))
    else:
        prev.weight.div_(s.to(prev.weight.dtype)[:, None])
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    for lin in group.linears.values():
        lin.weight.mul_(s.to(lin.weight.dtype)[None, :])


def layer_linears(layer: DecoderLayer) -> dict[str, nn.Linear]:
    """Every projection of a dense layer (names relative to it), grouped or not."""
    return {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}


def stacked_weight(group: ScaleGroup) -> torch.Tensor:
    """The group's weights as one [sum of outputs, in_features] fp32 matrix (they share the input)."""
    return torch.cat([lin.weight.detach().float() for lin in group.linears.values()])
