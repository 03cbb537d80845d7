"""Quantize a CausalLM in place (swap its decoder projections for quantized modules), and the
`baton quantize` pipeline around it."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch
from baton.common.checkpoint import CheckpointError, load_checkpoint, read_config
from baton.common.model import CausalLM
from baton.common.moe import GptOssExperts
from baton.common.tokenizer import Tokenizer
from baton.serve.quantization.awq import awq_layer
from baton.serve.quantization.calibration import (
    CalibrationConfig,
    CalibrationError,
    LayerRunner,
    calibration_tokens,
    check_calibration_size,
)
from baton.serve.quantization.config import QuantConfig
from baton.serve.quantization.gptq import gptq_layer
from baton.serve.quantization.linear import QuantLinear, set_module, target_linears
from baton.serve.quantization.loader import quantization_config, save_quantized
from baton.serve.quantization.rtn import rtn_linear
from baton.serve.quantization.scaling import scale_groups
from baton.serve.quantization.smoothquant import smoothquant_layer

log = logging.getLogger(__name__)
LAYER_STEPS = {"gptq": gptq_layer, "awq": awq_layer, "smoothquant": smoothquant_layer}
SCALED = ("awq", "smoothquant")  # the methods that fold scales into the layers (scaling.scale_groups)


def is_quantized(model: CausalLM) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


def log_float_experts(model: CausalLM) -> int:
    """gpt-oss's experts are stacked [E, H, 2I] / [E, I, H] tensors with biases, not linear layers: the
    quantized kernels take one [out, in] matrix per module, so they stay in float (its attention is
    quantized, its routers and sinks stay float like every model's). Says so; returns the parameter count."""
    stacked = [m for m in model.modules() if isinstance(m, GptOssExperts)]
    count = sum(p.numel() for m in stacked for p in m.parameters())
    if stacked:
        total = sum(p.numel() for p in model.parameters())
        log.warning(
            "gpt-oss's stacked experts (%d layers, %.0f%% of the parameters) stay in %s: they are not linear "
            "layers the quantized formats hold; the attention projections are quantized",
            len(stacked),
            100 * count / max(total, 1),
            next(stacked[0].parameters()).dtype,
        )
    return count


@torch.no_grad()
def quantize_model(model: CausalLM, qcfg: QuantConfig, tokens: torch.Tensor | None = None) -> CausalLM:
    """Quantize `model` (fp32 weights recommended) per `qcfg`; `tokens` [samples, seq_len] are the
    calibration set for the methods that need one. Returns the same model object."""
    if is_quantized(model):
        raise ValueError("the model is already quantized; quantize its float checkpoint instead")
    log_float_experts(model)
    if not qcfg.needs_calibration:
        for name, lin in target_linears(model).items():
            set_module(model, name, rtn_linear(lin, qcfg.format, qcfg.group_size))
        return model
    if tokens is None:
        raise CalibrationError(f"{qcfg.method} needs calibration tokens")
    check_calibration_size(tokens, model)
    mtp = list(model.mtp) if getattr(model, "mtp", None) is not None else []
    if qcfg.method in SCALED:  # refuses a MoE layer anywhere before the layers ahead of it are touched
        for layer in [*model.model.layers, *mtp]:
            scale_groups(layer)
    model.eval()
    runner = LayerRunner(model, tokens)
    step = LAYER_STEPS[qcfg.method]
    for i, layer in enumerate(model.model.layers):
        step(runner, layer, qcfg)
        runner.advance(layer)
        log.info("%s: quantized layer %d/%d", qcfg.method, i + 1, len(model.model.layers))
    if mtp:
        mtp_runner = runner.mtp()
        for layer in mtp:
            step(mtp_runner, layer, qcfg)
            mtp_runner.advance(layer)
        log.info("%s: quantized the %d MTP module(s)", qcfg.method, len(mtp))
    return model


def quantize_checkpoint(
    src: str | Path, out: str | Path, qcfg: QuantConfig, calib: CalibrationConfig | None = None
) -> Path:
    """`baton quantize`: float handoff checkpoint -> quantized handoff checkpoint. Every input is
    checked (checkpoint, not already quantized, tokenizer and data for calibration) before any work."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"checkpoint directory {src} does not exist")
    if quantization_config(src) is not None:
        raise ValueError(
            f"{src} is already quantized ({quantization_config(src).get('format')}); "
            "quantize its float checkpoint instead"
        )
    cfg = read_config(src)
    if qcfg.method in SCALED and any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        raise ValueError(f"{qcfg.method} supports dense (non-MoE) models; use gptq or rtn for MoE models")
    tokenizer = None
    if qcfg.needs_calibration:
        calib = calib or CalibrationConfig()
        if not (src / "tokenizer.json").is_file():
            raise CheckpointError(f"{src} has no tokenizer.json: {qcfg.method} needs one to tokenize calibration text")
        tokenizer = Tokenizer.from_dir(src)
    ckpt = load_checkpoint(src, dtype=torch.float32)  # all quantization math in fp32
    tokens = calibration_tokens(calib, tokenizer) if tokenizer is not None else None
    model = quantize_model(ckpt.model, qcfg, tokens)
    for p in model.parameters():  # the float parts go back to the checkpoint's dtype
        p.data = p.data.to(ckpt.config.dtype)
    extra = {"source": str(src.resolve()), "calibration": asdict(calib) if tokenizer is not None else None}
    return save_quantized(out, model, qcfg, tokenizer_dir=src, extra=extra)
