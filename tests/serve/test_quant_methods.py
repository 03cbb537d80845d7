"""GPTQ, AWQ and SmoothQuant against their objectives, measured independently of the searches:
errors are computed here from the stored (dequantized) weights, never from the methods' own losses."""

import copy

import pytest
import torch
from torch import nn

from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.kernels import smoothquant_scales
from baton.kernels.quant import quantize_int4_groupwise
from baton.kernels.reference import dequantize_int4
from baton.serve.quantization import QuantConfig, quantize_model
from baton.serve.quantization.awq import search_clip, search_scale
from baton.serve.quantization.gptq import gptq_quantize
from baton.serve.quantization.rtn import int4_module, int8_module, rtn_linear
from baton.serve.quantization.scaling import fold_scales, scale_groups


def _inputs(t=512, k=128, seed=0):
    """Correlated activations with a few outlier channels, like an LLM's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 16, generator=g) @ torch.randn(16, k, generator=g) + 0.3 * torch.randn(t, k, generator=g)
    x[:, :4] *= 10
    return x


def _layer_error(w, w_hat, x):
    """||W X - W_hat X||_F^2 on the calibration rows (x is [tokens, in])."""
    return ((x.double() @ (w.double() - w_hat.double()).T) ** 2).sum().item()


def _gptq_module(lin, x, bits, g, act_order):
    levels, scales, zeros = gptq_quantize(lin.weight, 2 * x.T @ x / x.shape[0], bits, g, act_order)
    return int8_module(lin, levels, scales) if bits == 8 else int4_module(lin, levels, scales, zeros, g)


@pytest.mark.parametrize(
    "bits,g,act_order", [(4, 32, False), (4, 128, False), (4, 32, True), (8, 128, False), (8, 128, True)]
)
def test_gptq_beats_round_to_nearest_on_the_layer_objective(bits, g, act_order):
    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=False)
    x = _inputs()
    gptq = _gptq_module(lin, x, bits, g, act_order)
    rtn = rtn_linear(lin, "int8" if bits == 8 else "int4", g)
    w = lin.weight.detach()
    assert _layer_error(w, gptq.dequantize(), x) < 0.8 * _layer_error(w, rtn.dequantize(), x)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_with_uncorrelated_inputs_is_round_to_nearest(bits):
    """With H = c*I there is no cross-column error to compensate: GPTQ must reduce to RTN exactly."""
    torch.manual_seed(1)
    lin = nn.Linear(64, 32, bias=False)
    levels, scales, zeros = gptq_quantize(lin.weight, 3 * torch.eye(64), bits, 32)
    got = int8_module(lin, levels, scales) if bits == 8 else int4_module(lin, levels, scales, zeros, 32)
    want = rtn_linear(lin, "int8" if bits == 8 else "int4", 32)
    assert torch.equal(got.qweight, want.qweight)


def _awq_error(x, w, s, g):
    """Independent: the kernels' int4 quantizer and reference dequantizer on w * s, inputs x / s."""
    packed, scales, zeros = quantize_int4_groupwise(w * s, g)
    return (((x / s) @ dequantize_int4(packed, scales, zeros, g).T - x @ w.T) ** 2).mean().item()


def test_awq_scale_search_is_never_worse_than_scale_one():
    torch.manual_seed(2)
    x, w = _inputs(k=128), torch.randn(96, 128)
    s = search_scale(x, w, group_size=32)
    ones = torch.ones(128)
    assert _awq_error(x, w, s, 32) <= _awq_error(x, w, ones, 32)
    assert _awq_error(x, w, s, 32) < 0.9 * _awq_error(x, w, ones, 32)  # outlier channels: scaling helps
    x_flat = torch.randn(256, 128)  # no outliers: whatever it picks is still no worse
    assert _awq_error(x_flat, w, search_scale(x_flat, w, 32), 32) <= _awq_error(x_flat, w, ones, 32)


def test_awq_clip_search_is_never_worse_than_no_clip():
    torch.manual_seed(3)
    x, w = _inputs(k=64), torch.randn(32, 64)
    w[:, 5] *= 6
    clipped = search_clip(x, w, 32)
    assert (clipped.abs() <= w.abs()).all()
    assert _awq_error(x, clipped, torch.ones(64), 32) <= _awq_error(x, w, torch.ones(64), 32) + 1e-12


def _tiny(seed=0, kv=2, **extra):
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv,
        max_position_embeddings=64,
        initializer_range=0.1,
        **extra,
    )
    model = build_model(cfg, seed=seed).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model


@pytest.mark.parametrize("kv,extra", [(2, {}), (4, {}), (4, {"qkv_bias": True})])  # GQA; MHA (v->o too); v bias
def test_scale_folding_keeps_the_float_model_identical(kv, extra):
    model = _tiny(kv=kv, **extra)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    before = model(ids)
    g = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        groups = scale_groups(layer)
        assert len(groups) == (4 if kv == 4 else 3)
        for group in groups:
            fold_scales(group, torch.rand(next(iter(group.linears.values())).in_features, generator=g) * 4 + 0.1)
    torch.testing.assert_close(model(ids), before, rtol=1e-4, atol=1e-4)


def test_smoothquant_reduces_w8a8_error_on_outlier_activations():
    """Smoothing with alpha moves outliers into the weights: the W8A8 product error drops."""
    torch.manual_seed(4)
    x, w = _inputs(k=128), torch.randn(64, 128) * 0.05
    lin, lin_s = nn.Linear(128, 64, bias=False), nn.Linear(128, 64, bias=False)
    s = smoothquant_scales(x.abs().amax(0), w, 0.5)
    lin.weight.data, lin_s.weight.data = w.clone(), w * s
    plain, smooth = rtn_linear(lin, "w8a8"), rtn_linear(lin_s, "w8a8")
    ref = x @ w.T
    err_plain = ((plain(x) - ref) ** 2).mean()
    err_smooth = ((smooth(x / s) - ref) ** 2).mean()
    assert err_smooth < 0.5 * err_plain


@pytest.mark.parametrize(
    "qcfg",
    [
        QuantConfig("gptq", 4, 32),
        QuantConfig("gptq", 8, act_order=True),
        QuantConfig("awq", 4, 32),
        QuantConfig("smoothquant", 8, alpha=None),
        QuantConfig("rtn", 4, 32),
        QuantConfig("fp8", 8),
    ],
    ids=lambda q: f"{q.method}{q.bits}",
)
def test_quantize_model_swaps_every_projection_and_stays_close(qcfg):
    model = _tiny()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(5))
    quantize_model(model, qcfg, tokens)
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith("_proj")}
    assert kinds == {
        {"int4": "Int4WeightLinear", "int8": "Int8WeightLinear", "fp8": "FP8WeightLinear", "w8a8": "W8A8Linear"}[
            qcfg.format
        ]
    }
    assert isinstance(model.lm_head, nn.Linear)
    ids = tokens[:2]
    p, q = torch.softmax(ref(ids), -1), torch.softmax(model(ids), -1)
    assert (p - q).abs().sum(-1).max() < (0.5 if qcfg.bits == 4 else 0.15)  # total variation, per position


@pytest.mark.parametrize("samples", [5, 16, 21])  # batches of 16: one partial, exact, and ragged
def test_layer_runner_reproduces_the_model_forward(samples):
    """Calibration activations must be the real ones: layer by layer equals the whole model."""
    from baton.serve.quantization.calibration import LayerRunner

    model = _tiny()
    tokens = torch.randint(0, 128, (samples, 12), generator=torch.Generator().manual_seed(6))
    runner = LayerRunner(model, tokens)
    for layer in model.model.layers:
        runner.advance(layer)
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(runner.x), model.hidden(tokens), rtol=1e-5, atol=1e-5)


def test_gptq_on_moe_quantizes_experts_and_keeps_the_router_float():
    model = _tiny(num_local_experts=3, num_experts_per_tok=1)
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(7))
    quantize_model(model, QuantConfig("gptq", 8), tokens)
    moe = model.model.layers[0].block_sparse_moe
    assert isinstance(moe.gate, nn.Linear) and all(type(e.w1).__name__ == "Int8WeightLinear" for e in moe.experts)
    p, q = torch.softmax(ref(tokens[:2]), -1), torch.softmax(model(tokens[:2]), -1)
    assert (p - q).abs().sum(-1).max() < 0.15
