"""Per-input-channel rescaling that leaves the float model unchanged (shared by AWQ and SmoothQuant).

For linears that read the output of one preceding op, y = W x = (W diag(s)) (x / s): the 1/s is
folded into that op (an RMSNorm's weight, or (some of) the rows of a preceding linear) and the linears
multiply their columns by s. The float function is identical; only what gets quantized changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from baton.common.mla import MLAttention
from baton.common.model import MLP, DecoderLayer, RMSNorm
from baton.common.mtp import MTPLayer
from baton.serve.quantization.calibration import CalibrationError
from baton.serve.quantization.linear import quantizable_linears
from torch import nn

MOE_REFUSAL = "AWQ and SmoothQuant support dense (non-MoE) models; use gptq or rtn for MoE models"


@dataclass
class ScaleGroup:
    prev: nn.Module  # RMSNorm or nn.Linear whose output is the linears' input
    linears: dict[str, nn.Linear]  # names relative to the decoder layer (or MTP module)
    prev_rows: torch.Tensor | None = None  # a linear prev's output rows that are the inputs, in order (None: all)


def scale_groups(layer: DecoderLayer | MTPLayer) -> list[ScaleGroup]:
    """Llama's four places (as in AutoAWQ / llm-compressor): norm -> q,k,v; v -> o (when every
    head has its own v, so a v channel feeds exactly one o input); norm -> gate,up; up -> down.
    The norms are the ones before each block: the input norm, and the post-attention norm ("pre",
    Llama) or the pre-feed-forward one ("sandwich", Gemma). OLMo 2's norms ("post") sit after the
    blocks, so q,k,v and gate,up read the bare residual stream and have no group (quantized unscaled);
    q/k norms come after q/k's outputs and change nothing here. MLA has places of its own (mla_groups);
    an MTP module (DeepSeek-V3) its block's, while its eh_proj, which reads two norms' outputs side by
    side (the embedding's and the hidden state's), is quantized unscaled.

    MoE layers are refused: the norm before the experts feeds every routed expert, whose inputs are
    only the tokens routed to it, so one scale searched over all tokens optimises a computation the
    layer never does (and the float router reads that norm too); each expert's up -> down group would
    rest on the few tokens routed to it. GPTQ's per-linear Hessians see exactly the routed tokens."""
    if isinstance(layer, MTPLayer):
        block = scale_groups(layer.block)
        return [ScaleGroup(g.prev, {f"block.{n}": m for n, m in g.linears.items()}, g.prev_rows) for g in block]
    if not isinstance(layer.ffn, MLP):
        raise CalibrationError(f"{MOE_REFUSAL} (layer {layer.self_attn.layer_idx} routes tokens to experts)")
    a, m = layer.self_attn, layer.ffn
    pre_attn = getattr(layer, "input_layernorm", None)
    pre_ffn = {"pre": layer.post_attention_layernorm, "sandwich": getattr(layer, "pre_feedforward_layernorm", None)}
    pre_ffn = pre_ffn.get(layer.norm_layout)
    if isinstance(a, MLAttention):
        groups = mla_groups(a, pre_attn)
    else:
        groups = []
        if pre_attn is not None:
            qkv = {f"self_attn.{n}": getattr(a, n) for n in ("q_proj", "k_proj", "v_proj")}
            groups.append(ScaleGroup(pre_attn, qkv))
        if a.v_proj.out_features == a.o_proj.in_features:
            groups.append(ScaleGroup(a.v_proj, {"self_attn.o_proj": a.o_proj}))
    if pre_ffn is not None:
        groups.append(ScaleGroup(pre_ffn, {"mlp.gate_proj": m.gate_proj, "mlp.up_proj": m.up_proj}))
    groups.append(ScaleGroup(m.up_proj, {"mlp.down_proj": m.down_proj}))
    return groups


def mla_groups(a: MLAttention, pre_attn: RMSNorm | None) -> list[ScaleGroup]:
    """Multi-head latent attention's places: norm -> (q_a_proj or q_proj), kv_a_proj_with_mqa;
    q_a_layernorm -> q_b_proj; kv_b_proj's value rows -> o_proj (every head decompresses its own v,
    so a v channel feeds exactly one o input; kv_b_proj is float, absorbed_linears, and stays exact).
    Not kv_a_layernorm -> kv_b_proj: kv_b_proj is not quantized, so that fold would only rescale the
    cached latent for nothing."""
    q_a = getattr(a, "q_a_proj", None)
    groups = []
    if pre_attn is not None:
        q = {"self_attn.q_a_proj": q_a} if q_a is not None else {"self_attn.q_proj": a.q_proj}
        groups.append(ScaleGroup(pre_attn, {**q, "self_attn.kv_a_proj_with_mqa": a.kv_a_proj_with_mqa}))
    if q_a is not None:
        groups.append(ScaleGroup(a.q_a_layernorm, {"self_attn.q_b_proj": a.q_b_proj}))
    nope, v = a.qk_nope_head_dim, a.v_head_dim  # kv_b_proj's rows: per head, nope key rows then v rows
    rows = (torch.arange(a.num_heads)[:, None] * (nope + v) + nope + torch.arange(v)).flatten()
    groups.append(ScaleGroup(a.kv_b_proj, {"self_attn.o_proj": a.o_proj}, rows.to(a.kv_b_proj.weight.device)))
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
        rows = slice(None) if group.prev_rows is None else group.prev_rows
        w = prev.weight
        w[rows] = (w[rows].float() / s.float()[:, None]).to(w.dtype)
        if prev.bias is not None:
            prev.bias[rows] = (prev.bias[rows].float() / s.float()).to(prev.bias.dtype)
    for lin in group.linears.values():
        lin.weight.mul_(s.to(lin.weight.dtype)[None, :])


def layer_linears(layer: DecoderLayer) -> dict[str, nn.Linear]:
    """Every quantized projection of a dense layer (names relative to it), grouped or not: all its
    linears but MLA's float kv_b_proj."""
    return quantizable_linears(layer)


def stacked_weight(group: ScaleGroup) -> torch.Tensor:
    """The group's weights as one [sum of outputs, in_features] fp32 matrix (they share the input)."""
    return torch.cat([lin.weight.detach().float() for lin in group.linears.values()])
