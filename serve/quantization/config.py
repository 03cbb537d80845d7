"""What `baton quantize` does, as one validated dataclass, and its `quantization_config` block.

The block follows Hugging Face's config.json convention (a `quantization_config` dict with a
`quant_method` key and AutoGPTQ/AutoAWQ field names: bits, group_size, desc_act, sym, zero_point,
modules_to_not_convert). `quant_method` is "baton" because the tensor layout is Baton's own (the
kernels' formats): transformers reads the name, reports it as unknown and does not misload it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

QUANT_METHOD = "baton"
METHODS = ("rtn", "gptq", "awq", "smoothquant", "fp8")
# Weight bits each method can produce: 8 = int8 per output channel, 4 = int4 group-wise.
METHOD_BITS = {"rtn": (4, 8), "gptq": (4, 8), "awq": (4,), "smoothquant": (8,), "fp8": (8,)}
GROUP_SIZES = (32, 64, 128)
NOT_CONVERTED = ["lm_head"]  # embeddings and the LM head stay in float, as GPTQ/AWQ leave them


class QuantConfigError(ValueError):
    """A quantization request that cannot be carried out; raised before any work."""


@dataclass
class QuantConfig:
    method: str = "rtn"
    bits: int = 8
    group_size: int = 128  # int4 only: input channels sharing one (scale, zero)
    act_order: bool = False  # GPTQ: quantize columns in order of decreasing Hessian diagonal
    damp_percent: float = 0.01  # GPTQ: diagonal damping, a fraction of the mean Hessian diagonal
    gptq_block_size: int = 128  # GPTQ: columns per lazy batch update
    alpha: float | None = 0.5  # SmoothQuant migration strength; None searches a grid per layer
    awq_grid: int = 20  # AWQ: ratios tried in the scale search
    awq_clip: bool = True  # AWQ: also search a per-group clipping range

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise QuantConfigError(msg)

        need(self.method in METHODS, f"unknown quantization method {self.method!r}; choose one of {', '.join(METHODS)}")
        allowed = METHOD_BITS[self.method]
        need(self.bits in allowed, f"{self.method} quantizes to {' or '.join(map(str, allowed))} bits, not {self.bits}")
        if self.bits == 4:
            need(
                self.group_size in GROUP_SIZES,
                f"unsupported group size {self.group_size}; int4 group sizes are {', '.join(map(str, GROUP_SIZES))}",
            )
        need(0 < self.damp_percent < 1, f"damp_percent must be in (0, 1), got {self.damp_percent}")
        need(self.gptq_block_size > 0, f"gptq_block_size must be positive, got {self.gptq_block_size}")
        need(
            self.alpha is None or 0 <= self.alpha <= 1, f"alpha must be in [0, 1] (or None to search), got {self.alpha}"
        )
        need(self.awq_grid >= 2, f"awq_grid must be at least 2, got {self.awq_grid}")

    @property
    def format(self) -> str:
        """The stored weight format, i.e. which quantized linear module serves it."""
        if self.method == "fp8":
            return "fp8"
        if self.method == "smoothquant":
            return "w8a8"
        return "int4" if self.bits == 4 else "int8"

    @property
    def needs_calibration(self) -> bool:
        return self.method in ("gptq", "awq", "smoothquant")

    def to_hf(self) -> dict[str, Any]:
        d = {
            "quant_method": QUANT_METHOD,
            "format": self.format,
            **asdict(self),
            "sym": self.format != "int4",
            "desc_act": self.act_order,
            "zero_point": self.format == "int4",
            "modules_to_not_convert": list(NOT_CONVERTED),
        }
        if self.format != "int4":
            d["group_size"] = -1  # HF's spelling of "per output channel"
        return d

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "QuantConfig":
        if d.get("quant_method") != QUANT_METHOD:
            raise QuantConfigError(
                f"quantization_config has quant_method {d.get('quant_method')!r}; "
                f"Baton loads only its own ({QUANT_METHOD!r})"
            )
        names = set(cls.__dataclass_fields__)
        kwargs = {k: v for k, v in d.items() if k in names}
        if kwargs.get("group_size") == -1:
            kwargs.pop("group_size")
        return cls(**kwargs)
