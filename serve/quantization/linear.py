"""Quantized linear layers, swapped into a CausalLM from outside (gpt-fast style).

Each module keeps nn.Linear's [out, in] layout and computes y = x @ dequant(W)^T + b through
baton.kernels' dispatching matmuls (Triton on CUDA, a torch path on CPU). Quantized tensors are
buffers, so state_dict() is the checkpoint: `qweight` (int8, packed int4 as uint8, or fp8 e4m3),
`scales` (fp32) and, for int4, `qzeros` (fp32, integer-valued, in [0, 15]).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from baton.common.mla import MLAttention
from baton.common.model import CausalLM
from baton.common.moe import MoE
from baton.common.mtp import SharedHead
from baton.kernels import fp8_weight_matmul, int4_weight_matmul, int8_weight_matmul, quantize_per_token, w8a8_matmul
from baton.kernels.reference import dequantize_int4
from torch import nn


class QuantLinear(nn.Module):
    format: ClassVar[str]

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        # Activations are cast to this around the matmul when set: on CPU torch's int8/int4 weight
        # GEMMs are only fast with bf16 activations (benchmarks/quantization.py measures it).
        self.compute_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x if self.compute_dtype is None else x.to(self.compute_dtype)
        y = self.matmul(xc).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The fp32 [out, in] weight this module multiplies by (the reference for tests)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8WeightLinear(QuantLinear):
    """W8A16: int8 per-output-channel symmetric weights."""

    format = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128):
        super().__init__(in_features, out_features, bias, group_size)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features))

    def matmul(self, x):
        return int8_weight_matmul(x, self.qweight, self.scales)

    def dequantize(self):
        return self.qweight.float() * self.scales[:, None]


class Int4WeightLinear(QuantLinear):
    """W4A16: int4 asymmetric group-wise weights, two per byte. An in_features that is not a whole
    number of groups is zero-padded to one (the kernels need whole groups); x is padded to match."""

    format = "int4"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128):
        super().__init__(in_features, out_features, bias, group_size)
        groups = -(-in_features // group_size)
        self.register_buffer("qweight", torch.empty(out_features, groups * group_size // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups))
        self.register_buffer("qzeros", torch.empty(out_features, groups))

    @property
    def padded_in_features(self) -> int:
        return self.qweight.shape[1] * 2

    def matmul(self, x):
        pad = self.padded_in_features - self.in_features
        if pad:
            x = F.pad(x, (0, pad))
        return int4_weight_matmul(x, self.qweight, self.scales, self.qzeros, self.group_size)

    def dequantize(self):
        return dequantize_int4(self.qweight, self.scales, self.qzeros, self.group_size)[:, : self.in_features]


class FP8WeightLinear(QuantLinear):
    """FP8 e4m3 weights with one scale per output channel."""

    format = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128):
        super().__init__(in_features, out_features, bias, group_size)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("scales", torch.empty(out_features))

    def matmul(self, x):
        return fp8_weight_matmul(x, self.qweight, self.scales)

    def dequantize(self):
        return self.qweight.float() * self.scales[:, None]


class W8A8Linear(QuantLinear):
    """SmoothQuant W8A8: int8 per-channel weights (already smoothed), int8 per-token activations
    quantized at run time, an int8 GEMM accumulating in int32."""

    format = "w8a8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 128):
        super().__init__(in_features, out_features, bias, group_size)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features))

    def matmul(self, x):
        q, s = quantize_per_token(x)
        return w8a8_matmul(q, s, self.qweight, self.scales, out_dtype=x.dtype)

    def dequantize(self):
        return self.qweight.float() * self.scales[:, None]


FORMATS: dict[str, type[QuantLinear]] = {
    c.format: c for c in (Int8WeightLinear, Int4WeightLinear, FP8WeightLinear, W8A8Linear)
}


def quantized_like(linear: nn.Linear, fmt: str, group_size: int = 128, **tensors: torch.Tensor) -> QuantLinear:
    """A `fmt` module shaped like `linear` holding `tensors` (checked against the format) and its bias."""
    mod = FORMATS[fmt](linear.in_features, linear.out_features, linear.bias is not None, group_size)
    for name, t in tensors.items():
        want = getattr(mod, name)
        if t.shape != want.shape or t.dtype != want.dtype:
            raise ValueError(f"{fmt} {name}: got {tuple(t.shape)} {t.dtype}, expected {tuple(want.shape)} {want.dtype}")
        setattr(mod, name, t.detach().contiguous())
    if linear.bias is not None:
        mod.bias = linear.bias.detach().float().clone()
    return mod.to(linear.weight.device)


def routers(module: nn.Module) -> set[int]:
    """ids of the MoE routers in `module` and of everything inside them: Mixtral's and Qwen3-MoE's
    `gate` (an nn.Linear), DeepSeek-V3's `gate` (whatever module holds its [E, H] weight and its
    score-correction bias) and gpt-oss's `router`."""
    found = set()
    for m in module.modules():
        if isinstance(m, MoE):
            for name in ("router", "gate"):
                router = getattr(m, name, None)
                if isinstance(router, nn.Module):
                    found.update(id(r) for r in router.modules())
    return found


def absorbed_linears(module: nn.Module) -> set[int]:
    """ids of MLA's kv_b_proj under `module`. It stays float: the latent backend multiplies queries and
    outputs by per-head slices of its weight (MLAttention.w_uk / w_uv, weight absorption), which no
    quantized [out, in] kernel computes, so a quantized copy would be dequantized again at load, as vLLM
    does (it saves no serving memory, only adds rounding error). It is small: kv_lora_rank x heads x
    (qk_nope + v) = 16.8M of DeepSeek-V3's ~11B parameters per MoE layer (0.15% of the model)."""
    return {id(m.kv_b_proj) for m in module.modules() if isinstance(m, MLAttention)}


def quantizable_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """The projections under `module` (names relative to it) that are quantized: every nn.Linear but
    the MoE routers, which stay float (tiny, and they steer the routing), MLA's kv_b_proj
    (absorbed_linears) and an MTP module's copy of the LM head (float like lm_head). Norms, gpt-oss's
    sinks and its stacked experts (parameters, not linears: see quantize.py) and DeepSeek-V3's
    score-correction bias are not linears and stay float too."""
    skip = routers(module) | absorbed_linears(module)
    skip |= {id(m.head) for m in module.modules() if isinstance(m, SharedHead) and m.head is not None}
    return {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear) and id(m) not in skip}


def target_linears(model: CausalLM) -> dict[str, nn.Linear]:
    """The quantized projections (quantizable_linears) of the decoder layers and of DeepSeek-V3's MTP
    modules (their eh_proj and block: a draft as large as a layer, quantized like one), by model names."""
    out = {f"model.layers.{name}": m for name, m in quantizable_linears(model.model.layers).items()}
    if getattr(model, "mtp", None) is not None:
        out.update({f"mtp.{name}": m for name, m in quantizable_linears(model.mtp).items()})
    return out


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def set_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.compute_dtype = dtype
