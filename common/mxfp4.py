"""MXFP4 (OCP microscaling FP4) weights, as gpt-oss's hub checkpoints store their experts.

Each run of 32 values along a weight's input dimension shares one e8m0 scale (a uint8 exponent:
2^(s - 127)); each value is an e2m1 nibble (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5,
2, 3, 4, 6 and their negatives), two per byte, the low nibble first. gpt-oss stores, per expert
projection `P` (gate_up_proj, down_proj):

    P_blocks  uint8 [E, out, in / 32, 16]      P_scales  uint8 [E, out, in / 32]

and its bf16 layout (the names Baton keeps) is P [E, in, out]. Baton dequantizes at import
(common/hf.py's normalize_hf_state_dict): the values are exact in bf16, so nothing is lost that a
bf16 checkpoint would keep; serving the 4-bit form directly is not done here.
"""

from __future__ import annotations

import re

import torch

# e2m1 nibble -> value (the sign is the high bit of the nibble).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
_PACKED = re.compile(r"^(.+)_(blocks|scales)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - 127).unsqueeze(-1))  # exact in float32
    return values.flatten(-2).to(dtype)


def dequantize_expert_weight(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """gpt-oss's P_blocks [E, out, G, 16] / P_scales [E, out, G] -> P [E, G * 32, out] (x @ P[e]),
    one expert at a time (a whole 120B layer in float32 at once would take GBs)."""
    experts, rows, groups = scales.shape
    out = torch.empty(experts, groups * BLOCK, rows, dtype=dtype, device=blocks.device)
    for e in range(experts):
        out[e] = dequantize_mxfp4(blocks[e], scales[e], dtype).T
    return out


def dequantize_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every `P_blocks`/`P_scales` pair of `state` replaced by P in `dtype`; other tensors as they are."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _PACKED.match(name)
        if m and t.dtype == torch.uint8:
            pairs.setdefault(m.group(1), {})[m.group(2)] = t
        else:
            out[name] = t
    for name, pair in pairs.items():
        if set(pair) != {"blocks", "scales"}:
            raise ValueError(f"MXFP4 tensor {name!r} has {sorted(pair)} but needs both blocks and scales")
        out[name] = dequantize_expert_weight(pair["blocks"], pair["scales"], dtype)
    return out
