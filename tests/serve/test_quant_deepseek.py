"""The quantizers and the quantized loader on DeepSeek-V3 (multi-head latent attention, DeepSeekMoE, MTP).

Per method: RTN int8/int4, FP8 and GPTQ quantize MLA's projections (but kv_b_proj), the dense MLPs,
every routed and shared expert and the MTP module's eh_proj and block; the router's weight and its
score-correction bias, the norms and kv_b_proj (absorbed by the latent backend) stay float, bit for bit.
AWQ and SmoothQuant refuse a model with MoE layers before touching a weight, and quantize a dense MLA
model through MLA's own scale groups. References: transformers' DeepseekV3ForCausalLM holding the
dequantized weights (1e-4), the float model (loose relative bounds: random tiny models), the
in-memory quantized model for the saved-and-loaded one (bit-identical), and the no-cache greedy
decoder on the quantized weights for the paged engine (latent cache, MTP speculation too).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from baton.common.checkpoint import load_checkpoint, save_checkpoint, save_model
from baton.common.hf_config import config_from_hf
from baton.common.mla import MLAttention
from baton.common.model import MLP, CausalLM, RMSNorm, greedy_generate, init_weights
from baton.common.mtp import checkpoint_name
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.quantization import QuantConfig, load_model, quantize_model, save_quantized
from baton.serve.quantization.calibration import CalibrationError
from baton.serve.quantization.linear import QuantLinear, set_compute_dtype
from baton.serve.quantization.quantize import quantize_checkpoint
from baton.serve.quantization.scaling import fold_scales, scale_groups
from baton.serve.runner.mla_attention import LatentPagedAttention
from baton.serve.sampling_params import SamplingParams
from baton.serve.speculative import SpeculativeConfig
from torch import nn

from .conftest import run_staggered

VOCAB = 97
# Odd widths (hidden 72, 3 heads, nope 24, rope 8, v 20, latent 36, q LoRA 28): int4 groups of 32
# pad every input, and a mis-split kv_b_proj row cannot line up by accident.
MLA = dict(
    vocab_size=VOCAB,
    hidden_size=72,
    intermediate_size=48,
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=36,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=20,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    num_nextn_predict_layers=1,
)
# A dense first layer, then 8 experts in 4 groups (2 kept per token, 3 experts chosen), a shared expert.
MOE = dict(
    num_hidden_layers=3,
    q_lora_rank=28,
    n_routed_experts=8,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    n_shared_experts=1,
    moe_intermediate_size=20,
    first_k_dense_replace=1,
)
DENSE = dict(num_hidden_layers=2, q_lora_rank=28, n_routed_experts=0, first_k_dense_replace=2)
CALIB = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
IDS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
# Relative logit error ||q - f|| / ||f|| measured on these models (main head and MTP head): int8 <= 0.05,
# int4 (RTN, GPTQ, AWQ) 0.2-0.36, fp8 <= 0.15, W8A8 <= 0.03. A router, a norm or kv_b_proj garbled, or
# a layer skipped, lands far outside these bounds.
MAX_ERROR = {"int4": 0.5, "int8": 0.1, "fp8": 0.3, "w8a8": 0.1}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def build(overrides: dict, seed: int = 0) -> CausalLM:
    """A random fp32 model from transformers' DeepseekV3Config, its norms and correction biases moved
    off their initial values (so each of them changes the logits)."""
    cfg = config_from_hf(transformers.DeepseekV3Config(**MLA, **overrides).to_dict())
    model = init_weights(CausalLM(cfg), seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


@torch.no_grad()
def outputs(model: CausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, the MTP module's logits) on IDS."""
    return model(IDS), model.mtp_logits(IDS)[0]


def error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def moe():
    model = build(MOE)
    return model, outputs(model)


@pytest.fixture(scope="module")
def quantized(moe, tmp_path_factory):
    """method name -> (the quantized MoE model, its saved checkpoint), quantized once per module."""
    made = {}

    def get(qcfg: QuantConfig):
        key = f"{qcfg.method}{qcfg.bits}"
        if key not in made:
            model = quantize_model(copy.deepcopy(moe[0]), qcfg, CALIB)
            made[key] = model, save_quantized(tmp_path_factory.mktemp(key) / "q", model, qcfg)
        return made[key]

    return get


def check_modules(model: CausalLM, ref: CausalLM) -> None:
    """Projections quantized; norms, routers, correction biases and kv_b_proj float and unchanged."""
    blocks = [*model.model.layers, *(m.block for m in model.mtp)]
    refs = [*ref.model.layers, *(m.block for m in ref.mtp)]
    assert isinstance(model.mtp[0].eh_proj, QuantLinear)
    for layer, want in zip(blocks, refs):
        a = layer.self_attn
        assert isinstance(a, MLAttention)
        names = ("q_a_proj", "q_b_proj") if a.q_lora_rank else ("q_proj",)
        assert all(isinstance(getattr(a, n), QuantLinear) for n in (*names, "kv_a_proj_with_mqa", "o_proj"))
        assert type(a.kv_b_proj) is nn.Linear and torch.equal(a.kv_b_proj.weight, want.self_attn.kv_b_proj.weight)
        ffn = layer.ffn
        if isinstance(ffn, MLP):
            assert all(isinstance(m, QuantLinear) for m in ffn.children())
        else:
            gate, want_gate = ffn.gate, want.ffn.gate
            assert not isinstance(gate, QuantLinear) and torch.equal(gate.weight, want_gate.weight)
            bias = gate.e_score_correction_bias
            assert bias.dtype == torch.float32 and torch.equal(bias, want_gate.e_score_correction_bias)
            experts = [*ffn.experts, ffn.shared_experts]
            assert all(isinstance(m, QuantLinear) for e in experts for m in e.children())
    for m, want in zip(model.modules(), ref.modules()):
        if isinstance(m, RMSNorm):
            assert torch.equal(m.weight, want.weight)


@pytest.mark.parametrize(
    "qcfg",
    [QuantConfig("rtn", 8), QuantConfig("rtn", 4, 32), QuantConfig("fp8", 8), QuantConfig("gptq", 4, 32)],
    ids=["rtn8", "rtn4", "fp8", "gptq4"],
)
def test_projections_quantize_and_the_router_bias_and_kv_b_proj_stay_float(moe, quantized, qcfg):
    float_model, (ref, ref_mtp) = moe
    model, out = quantized(qcfg)
    check_modules(model, float_model)
    logits, mtp = outputs(model)
    assert error(logits, ref) < MAX_ERROR[qcfg.format] and error(mtp, ref_mtp) < MAX_ERROR[qcfg.format]
    block = json.loads((out / "config.json").read_text())["quantization_config"]
    assert block["modules_to_not_convert"] == ["lm_head", "kv_b_proj"]
    loaded = load_model(out).model
    check_modules(loaded, float_model)
    set_compute_dtype(loaded, None)  # exact activations (int8 on CPU serves with bf16 ones)
    got, got_mtp = outputs(loaded)
    assert torch.equal(got, logits) and torch.equal(got_mtp, mtp), "saved and loaded: the same logits"


def test_the_quantized_model_is_transformers_with_the_dequantized_weights(moe, quantized, tmp_path):
    """An independent reference for MLA and DeepSeekMoE running on quantized linears."""
    model, _ = quantized(QuantConfig("rtn", 4, 32))
    state = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            state[f"{name}.weight"] = m.dequantize()
    state.update({k: v for k, v in model.state_dict().items() if not k.endswith(("qweight", "scales", "qzeros"))})
    n = model.config.num_hidden_layers
    d = save_checkpoint(tmp_path / "dequantized", model.config, {checkpoint_name(k, n): v for k, v in state.items()})
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(d).eval()  # (ignores the MTP module's tensors)
    with torch.no_grad():
        want = hf(IDS).logits
        assert (model(IDS) - want).abs().max() < 1e-4 and want.std() > 0.3


def test_gptq_checkpoint_serves_from_the_latent_cache_with_mtp_speculation(quantized):
    """The paged engine (latent cache, absorbed decode) = the no-cache decoder on the quantized weights."""
    _, out = quantized(QuantConfig("gptq", 4, 32))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 23)]
    for spec in (None, SpeculativeConfig("mtp", 2)):
        engine = LLMEngine.from_checkpoint(out, EngineConfig(num_kv_blocks=64, block_size=8, speculative=spec))
        assert type(engine.runner.attn) is LatentPagedAttention
        got = run_staggered(engine, prompts, GREEDY, every=1)
        assert got == [greedy_generate(engine.model, torch.tensor([p]), 8)[0].tolist() for p in prompts]
    assert engine.stats().spec_proposed_tokens > 0


@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_awq_and_smoothquant_refuse_moe_layers_before_any_work(moe, tmp_path, method):
    model = copy.deepcopy(moe[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qcfg = QuantConfig(method, 4 if method == "awq" else 8, 32)
    with pytest.raises(CalibrationError, match=r"dense \(non-MoE\) models; use gptq or rtn .*layer 1 routes"):
        quantize_model(model, qcfg, CALIB)
    after = model.state_dict()  # layer 0 (dense) was not quantized or rescaled either
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    src = save_model(tmp_path / "float", moe[0])
    with pytest.raises(ValueError, match="supports dense .non-MoE. models"):
        quantize_checkpoint(src, tmp_path / "q", qcfg)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("q_lora_rank", [28, None])
def test_mla_scale_groups_keep_the_float_model(q_lora_rank):
    """Random scales folded into every MLA group (and the MTP block's) leave the logits as they were:
    the 1/s lands in the input norm, q_a_layernorm and kv_b_proj's value rows, never in the latent."""
    model = build({**DENSE, "q_lora_rank": q_lora_rank})
    ref, ref_mtp = outputs(model)
    latent_norms = [layer.self_attn.kv_a_layernorm.weight.clone() for layer in model.model.layers]
    g = torch.Generator().manual_seed(4)
    for layer in [*model.model.layers, *model.mtp]:
        groups = scale_groups(layer)
        q = ["self_attn.q_a_proj"] if q_lora_rank else ["self_attn.q_proj"]
        names = [[n.removeprefix("block.") for n in x.linears] for x in groups]
        assert names[0] == [*q, "self_attn.kv_a_proj_with_mqa"] and ["self_attn.o_proj"] in names
        assert (["self_attn.q_b_proj"] in names) == (q_lora_rank is not None)
        assert not any("kv_b_proj" in n for x in names for n in x)
        for group in groups:
            fold_scales(group, torch.rand(next(iter(group.linears.values())).in_features, generator=g) + 0.5)
    got, got_mtp = outputs(model)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    torch.testing.assert_close(got_mtp, ref_mtp, rtol=1e-4, atol=1e-4 * ref_mtp.abs().max().item())
    assert all(
        torch.equal(layer.self_attn.kv_a_layernorm.weight, w) for layer, w in zip(model.model.layers, latent_norms)
    )


@pytest.mark.parametrize(
    "qcfg", [QuantConfig("awq", 4, 32, awq_grid=5), QuantConfig("smoothquant", 8)], ids=["awq", "smoothquant"]
)
def test_awq_and_smoothquant_quantize_a_dense_mla_model(tmp_path, qcfg):
    float_model = build(DENSE)
    ref, ref_mtp = outputs(float_model)
    model = quantize_model(copy.deepcopy(float_model), qcfg, CALIB)
    logits, mtp = outputs(model)
    assert error(logits, ref) < MAX_ERROR[qcfg.format] and error(mtp, ref_mtp) < MAX_ERROR[qcfg.format]
    for layer in [*model.model.layers, *(m.block for m in model.mtp)]:
        assert all(isinstance(m, QuantLinear) for m in layer.mlp.children())
        assert type(layer.self_attn.kv_b_proj) is nn.Linear and isinstance(layer.self_attn.o_proj, QuantLinear)
    out = save_quantized(tmp_path / "q", model, qcfg)
    got, got_mtp = outputs(load_model(out).model)
    assert torch.equal(got, logits) and torch.equal(got_mtp, mtp)
    # kv_b_proj's value rows carry o_proj's 1/s: the absorbed decode reads them as the naive form does
    engine = LLMEngine.from_checkpoint(out, EngineConfig(num_kv_blocks=32, block_size=8))
    prompt = IDS[0, :11].tolist()
    assert run_staggered(engine, [prompt], GREEDY) == [
        greedy_generate(engine.model, torch.tensor([prompt]), 8)[0].tolist()
    ]


def test_a_bf16_checkpoint_keeps_its_router_bias_in_fp32(moe, tmp_path):
    model = copy.deepcopy(moe[0]).to(torch.bfloat16)
    model.config.torch_dtype = "bfloat16"
    src = save_model(tmp_path / "bf16", model)
    loaded = load_model(quantize_checkpoint(src, tmp_path / "q", QuantConfig("rtn", 4, 32))).model
    source = load_checkpoint(src).model
    moe_layer, want = loaded.model.layers[1].mlp, source.model.layers[1].mlp
    assert moe_layer.gate.weight.dtype == torch.bfloat16 and torch.equal(moe_layer.gate.weight, want.gate.weight)
    bias = moe_layer.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, want.gate.e_score_correction_bias)
    attn = loaded.model.layers[1].self_attn
    assert attn.kv_b_proj.weight.dtype == torch.bfloat16 and attn.o_proj.scales.dtype == torch.float32
    assert loaded(IDS).dtype == torch.bfloat16


def test_gptq_calibrates_the_mtp_module_on_its_own_inputs(moe, quantized):
    """The MTP module's linears get Hessians from the calibration set fed through it (not the
    round-to-nearest fallback of a linear that saw no input): on the inputs eh_proj and the block's
    o_proj really see, GPTQ's weights beat round-to-nearest's."""
    float_model = moe[0]
    gptq, _ = quantized(QuantConfig("gptq", 4, 32))
    rtn, _ = quantized(QuantConfig("rtn", 4, 32))
    modules = {"eh_proj": lambda m: m.mtp[0].eh_proj, "o_proj": lambda m: m.mtp[0].block.self_attn.o_proj}
    seen = {}

    def keep(name):
        def hook(_module, args):
            seen[name] = args[0].reshape(-1, args[0].shape[-1])

        return hook

    hooks = [get(float_model).register_forward_pre_hook(keep(name)) for name, get in modules.items()]
    with torch.no_grad():
        float_model.mtp_logits(CALIB)
    for h in hooks:
        h.remove()
    for name, get in modules.items():
        x, w = seen[name], get(float_model).weight

        def err(q):
            return ((x @ (get(q).dequantize() - w).T) ** 2).sum().item()

        assert err(gptq) < 0.9 * err(rtn), name
