"""The perplexity harness against independent computations, and `baton eval`'s input checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from baton.common.cli import main
from baton.common.config import ModelConfig
from baton.common.data import DataConfig
from baton.common.model import build_model
from baton.common.tokenizer import Tokenizer
from baton.serve.eval import EvalConfig, evaluate, heldout_tokens, perplexity, windows
from baton.serve.quantization.calibration import CalibrationConfig, calibration_tokens

from .conftest import TEXT


def _model(seed=0):
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    return build_model(cfg, seed=seed).eval()


@pytest.mark.parametrize("n,window,stride", [(100, 32, 16), (100, 32, 31), (33, 32, 8), (5, 32, 4)])
def test_windows_score_every_token_but_the_first_exactly_once(n, window, stride):
    scored = []
    for begin, end, k in windows(n, window, stride):
        assert 0 < k < end - begin + 1 and end - begin <= window
        scored += range(end - k, end)
    assert scored == list(range(1, n))


def test_one_token_overlap_equals_per_chunk_cross_entropy():
    """stride = window - 1: chunks sharing one token; each scores its own continuation."""
    model, tokens = _model(), torch.randint(0, 96, (94,), generator=torch.Generator().manual_seed(0))
    got = perplexity(model, tokens, EvalConfig(window=32, stride=31, batch_size=2))
    with torch.no_grad():
        chunks = [tokens[i : i + 32] for i in range(0, 93, 31)]
        nll = sum(F.cross_entropy(model(c[None])[0, :-1], c[1:], reduction="sum").item() for c in chunks)
    assert got.num_tokens == 93
    assert got.perplexity == pytest.approx(math.exp(nll / 93), rel=1e-5)


def test_window_covering_the_stream_equals_one_full_forward():
    model, tokens = _model(), torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1))
    got = perplexity(model, tokens, EvalConfig(window=64, stride=16))
    with torch.no_grad():
        want = F.cross_entropy(model(tokens[None])[0, :-1], tokens[1:]).item()
    assert got.nll == pytest.approx(want, rel=1e-5)


def test_uniform_model_has_perplexity_vocab_size():
    model = _model()
    torch.nn.init.zeros_(model.lm_head.weight)
    got = perplexity(model, torch.randint(0, 96, (80,)), EvalConfig(window=32, stride=16))
    assert got.perplexity == pytest.approx(96, rel=1e-5)


def test_agreement_with_itself_and_with_another_model():
    model, other, tokens = (
        _model(0),
        _model(1),
        torch.randint(0, 96, (120,), generator=torch.Generator().manual_seed(2)),
    )
    cfg = EvalConfig(window=32, stride=16, greedy_prompts=3, greedy_prompt_len=8, greedy_new_tokens=6)
    same = evaluate(model, tokens, cfg, reference=model)
    assert same.top1_agreement == 1 and same.greedy_match == 1 and same.perplexity_delta == 0
    diff = evaluate(model, tokens, cfg, reference=other)
    assert diff.top1_agreement < 0.5 and diff.greedy_match < 0.5
    assert diff.reference_perplexity == pytest.approx(perplexity(other, tokens, cfg).perplexity)


def test_heldout_stream_is_disjoint_from_calibration(llama_dir, tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("".join(f"Line {i}: {TEXT[i % 300 : i % 300 + 40]}\n" for i in range(600)))
    tok = Tokenizer.from_dir(llama_dir)
    data = DataConfig(path=str(path), seq_len=32, val_fraction=0.1, cache_dir=str(tmp_path / "ds"))
    held = heldout_tokens(EvalConfig(data), tok).reshape(-1, 33)
    calib = calibration_tokens(CalibrationConfig(data, num_samples=40), tok)
    assert len(held) > 0
    held_rows = {tuple(r[:32].tolist()) for r in held}
    assert not held_rows & {tuple(r.tolist()) for r in calib}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["MISSING"], "not a checkpoint directory"),
        (["CKPT", "--reference", "MISSING"], "not a checkpoint directory"),
        (["CKPT", "--data", "/no/such.txt"], "no such file or directory"),
        (["CKPT", "--stride", "128"], "stride must be in 1..window - 1"),
    ],
)
def test_cli_eval_bad_input(llama_dir, tmp_path, capsys, argv, message):
    argv = [str(llama_dir) if a == "CKPT" else str(tmp_path / "missing") if a == "MISSING" else a for a in argv]
    assert main(["eval", *argv]) == 2
    assert message in capsys.readouterr().err
