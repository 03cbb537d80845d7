"""Quantized checkpoints: `baton quantize` end to end, save -> load -> identical logits, loading and
generating through LLM, and bad input rejected with a clear error before any work."""

import json

import pytest
import torch

from baton.common.checkpoint import CheckpointError, load_checkpoint
from baton.common.data import DataConfig
from baton.common.cli import main
from baton.common.model import greedy_generate
from baton.serve.engine import EngineConfig
from baton.serve.llm import LLM
from baton.serve.quantization import QuantConfig, QuantConfigError, load_model, save_quantized
from baton.serve.quantization.calibration import CalibrationConfig, CalibrationError
from baton.serve.quantization.linear import set_compute_dtype
from baton.serve.quantization.quantize import quantize_checkpoint, quantize_model
from baton.serve.sampling_params import SamplingParams

from .conftest import TEXT


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(TEXT * 8)
    return path


def _calib(corpus, tmp_path, n=16):
    data = DataConfig(path=str(corpus), seq_len=32, val_fraction=0.1, cache_dir=str(tmp_path / "ds"))
    return CalibrationConfig(data, num_samples=n)


METHODS = [
    QuantConfig("rtn", 8),
    QuantConfig("rtn", 4, 32),
    QuantConfig("gptq", 4, 64, act_order=True),
    QuantConfig("awq", 4, 128),
    QuantConfig("smoothquant", 8),
    QuantConfig("fp8", 8),
]


@pytest.mark.parametrize("qcfg", METHODS, ids=lambda q: f"{q.method}{q.bits}")
def test_save_load_same_logits_and_generate_through_llm(llama_dir, tmp_path, qcfg):
    model = load_checkpoint(llama_dir).model
    calib = torch.randint(0, 320, (16, 32), generator=torch.Generator().manual_seed(1))
    quantize_model(model, qcfg, calib)
    out = save_quantized(tmp_path / "q", model, qcfg, tokenizer_dir=llama_dir)
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (
        raw["quant_method"] == "baton" and raw["format"] == qcfg.format and raw["modules_to_not_convert"] == ["lm_head"]
    )
    loaded = load_model(out).model
    set_compute_dtype(loaded, None)  # exact activations (on CPU int8 defaults to bf16 ones, tested below)
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(ids), model(ids))
    # Through the serving engine (paged KV cache, continuous batching): the same greedy tokens as the
    # no-cache reference decoder on the same quantized weights.
    llm = LLM(out, EngineConfig(num_kv_blocks=64, block_size=8))
    prompts = [ids[0, :10].tolist(), ids[1, :5].tolist()]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == greedy_generate(llm.engine.model, torch.tensor([prompt]), 12)[0].tolist()
    assert isinstance(llm.generate("The quick brown", SamplingParams(max_tokens=4))[0].outputs[0].text, str)


def test_loaded_int8_runs_the_bf16_cpu_fast_path(llama_dir, tmp_path):
    """int8 on CPU serves with bf16 activations by default. Regression: torch's int8 GEMM with bf16
    activations crashed on weights read straight from safetensors (not 64-byte aligned)."""
    out = quantize_checkpoint(llama_dir, tmp_path / "q", QuantConfig("rtn", 8))
    model = load_model(out).model
    assert model.model.layers[0].mlp.up_proj.compute_dtype == torch.bfloat16
    assert all(b.data_ptr() % 64 == 0 for n, b in model.named_buffers() if n.endswith("qweight"))
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    fast = model(ids)
    set_compute_dtype(model, None)
    exact = model(ids)
    torch.testing.assert_close(fast, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())


def test_quantized_checkpoint_is_smaller(llama_dir, tmp_path):
    out = quantize_checkpoint(llama_dir, tmp_path / "q", QuantConfig("rtn", 4, 32))
    size = lambda d: (d / "model.safetensors").stat().st_size
    projections = sum(
        m.weight.numel() * 4 for n, m in load_checkpoint(llama_dir).model.named_modules() if n.endswith("_proj")
    )
    assert size(out) < size(llama_dir) - 0.75 * projections  # int4 + group scales: ~1/5 of fp32


def test_tampered_tensor_is_rejected(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    out = quantize_checkpoint(llama_dir, tmp_path / "q", QuantConfig("rtn", 8))
    state = load_file(out / "model.safetensors")
    state["model.layers.0.mlp.up_proj.qweight"] = state["model.layers.0.mlp.up_proj.qweight"].float()
    save_file(state, out / "model.safetensors")
    with pytest.raises(CheckpointError, match="up_proj.qweight"):
        load_model(out, verify=False)


def test_requantizing_a_quantized_checkpoint_is_refused(llama_dir, tmp_path):
    out = quantize_checkpoint(llama_dir, tmp_path / "q", QuantConfig("rtn", 8))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(out, tmp_path / "qq", QuantConfig("rtn", 4))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(load_model(out).model, QuantConfig("rtn", 4))


def test_bad_configs_fail_on_construction():
    with pytest.raises(QuantConfigError, match="unknown quantization method"):
        QuantConfig("nf4", 4)
    with pytest.raises(QuantConfigError, match="unsupported group size 48"):
        QuantConfig("gptq", 4, 48)
    with pytest.raises(QuantConfigError, match="awq quantizes to 4 bits"):
        QuantConfig("awq", 8)


def test_calibration_set_too_small(llama_dir, corpus, tmp_path):
    with pytest.raises(CalibrationError, match="calibration set too small: .* training blocks"):
        quantize_checkpoint(llama_dir, tmp_path / "q", QuantConfig("gptq", 4, 32), _calib(corpus, tmp_path, n=10_000))
    with pytest.raises(CalibrationError, match="fewer than the 96 input channels"):
        quantize_checkpoint(llama_dir, tmp_path / "q", QuantConfig("gptq", 4, 32), _calib(corpus, tmp_path, n=2))
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--method", "nf4"], "invalid choice: 'nf4'"),
        (["--method", "gptq", "--group-size", "100"], "unsupported group size 100"),
        (["--method", "gptq", "--data", "/no/such/file.txt"], "no such file or directory"),
    ],
)
def test_cli_quantize_bad_input(llama_dir, tmp_path, capsys, argv, message):
    try:
        rc = main(["quantize", str(llama_dir), str(tmp_path / "q"), *argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_cli_quantize_missing_checkpoint(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "nope"), str(tmp_path / "q"), "--method", "rtn"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_quantize_then_eval(llama_dir, corpus, tmp_path, capsys):
    common = ["--data", str(corpus), "--seq-len", "32", "--val-fraction", "0.1"]
    assert (
        main(
            [
                "quantize",
                str(llama_dir),
                str(tmp_path / "q"),
                "--method",
                "gptq",
                "--group-size",
                "32",
                "--calib-samples",
                "16",
                *common,
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "eval",
                str(tmp_path / "q"),
                "--reference",
                str(llama_dir),
                "--window",
                "32",
                "--stride",
                "16",
                "--json",
                str(tmp_path / "r.json"),
                *common,
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["perplexity"] > 1 and 0 <= result["top1_agreement"] <= 1 and result["reference_perplexity"] > 1


def test_bf16_checkpoint_keeps_bf16_float_parts(llama_dir, tmp_path):
    from baton.common.checkpoint import save_model

    model = load_checkpoint(llama_dir, dtype=torch.bfloat16).model
    model.config.torch_dtype = "bfloat16"
    src = save_model(tmp_path / "bf16", model, tokenizer_dir=llama_dir)
    loaded = load_model(quantize_checkpoint(src, tmp_path / "q", QuantConfig("rtn", 4, 32))).model
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.layers[0].mlp.up_proj.scales.dtype == torch.float32
    assert loaded(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16
