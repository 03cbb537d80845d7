"""Weight (and KV-cache) quantization and structured pruning for serving.

`baton quantize` = calibration.calibration_tokens -> quantize.quantize_model -> loader.save_quantized;
LLM / LLMEngine.from_checkpoint load the result through loader.load_model. See docs/benchmarks.md.
"""

from baton.serve.quantization.config import QuantConfig, QuantConfigError
from baton.serve.quantization.loader import load_model, save_quantized
from baton.serve.quantization.quantize import quantize_model

__all__ = ["QuantConfig", "QuantConfigError", "quantize_model", "save_quantized", "load_model"]
