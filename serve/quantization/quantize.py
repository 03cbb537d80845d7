"""Quantize a CausalLM in place: swap its decoder projections for quantized modules."""

from __future__ import annotations

import logging

import torch

from baton.common.model import CausalLM
from baton.serve.quantization.awq import awq_layer
from baton.serve.quantization.calibration import CalibrationError, LayerRunner, check_calibration_size
from baton.serve.quantization.config import QuantConfig
from baton.serve.quantization.gptq import gptq_layer
from baton.serve.quantization.linear import QuantLinear, set_module, target_linears
from baton.serve.quantization.rtn import rtn_linear
from baton.serve.quantization.smoothquant import smoothquant_layer

log = logging.getLogger(__name__)
LAYER_STEPS = {"gptq": gptq_layer, "awq": awq_layer, "smoothquant": smoothquant_layer}


def is_quantized(model: CausalLM) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


@torch.no_grad()
def quantize_model(model: CausalLM, qcfg: QuantConfig, tokens: torch.Tensor | None = None) -> CausalLM:
    """Quantize `model` (fp32 weights recommended) per `qcfg`; `tokens` [samples, seq_len] are the
    calibration set for the methods that need one. Returns the same model object."""
    if is_quantized(model):
        raise ValueError("the model is already quantized; quantize its float checkpoint instead")
    if not qcfg.needs_calibration:
        for name, lin in target_linears(model).items():
            set_module(model, name, rtn_linear(lin, qcfg.format, qcfg.group_size))
        return model
    if tokens is None:
        raise CalibrationError(f"{qcfg.method} needs calibration tokens")
    check_calibration_size(tokens, model)
    model.eval()
    runner = LayerRunner(model, tokens)
    step = LAYER_STEPS[qcfg.method]
    for i, layer in enumerate(model.model.layers):
        step(runner, layer, qcfg)
        runner.advance(layer)
        log.info("%s: quantized layer %d/%d", qcfg.method, i + 1, len(model.model.layers))
    return model
