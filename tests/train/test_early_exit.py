"""LayerSkip training: the dropout schedule, the exit weights and the loss against hand computations;
a short fine-tuning run records the exits in a handoff that transformers still loads."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from baton.common.checkpoint import load_checkpoint, save_model
from baton.common.config import ConfigError, ModelConfig
from baton.common.model import build_model
from baton.common.tokenizer import train_char
from baton.train.recipe import config_from_dict
from baton.train.early_exit import EarlyExit, EarlyExitConfig, dropout_rate, exit_weights
from baton.train.trainer import train

from .conftest import PATTERN_TEXT

L = 4
CFG = ModelConfig(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=L,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
)


def test_dropout_schedule_is_layerskips():
    lin = EarlyExitConfig(layer_dropout=0.3)
    assert [dropout_rate(lin, l, L, 0, 100) for l in range(L)] == pytest.approx([0, 0.1, 0.2, 0.3])
    exp = EarlyExitConfig(layer_dropout=0.3, dropout_shape="exp")
    assert [dropout_rate(exp, l, L, 7, 100) for l in range(L)] == pytest.approx(
        [0.3 * (2 ** (l / 3) - 1) for l in range(L)]
    )
    warm = EarlyExitConfig(layer_dropout=0.3, dropout_warmup="exp")  # S(t) = 2^(t/(T-1)) - 1
    assert dropout_rate(warm, 3, L, 0, 11) == 0
    assert dropout_rate(warm, 3, L, 5, 11) == pytest.approx(0.3 * (2**0.5 - 1))
    assert dropout_rate(warm, 3, L, 10, 11) == pytest.approx(0.3)


def test_exit_weights_are_layerskips():
    # e_E = s * sum_{i<E} i: 1 and 3 (s=1); final: (L-1) + s * sum_{i<L-1} i = 3 + 3 = 6
    assert exit_weights(EarlyExitConfig(exit_layers=[2, 3]), L, 0) == pytest.approx({2: 0.1, 3: 0.3, 4: 0.6})
    assert exit_weights(EarlyExitConfig(exit_layers=[2, 3], loss_scale=0.5), L, 0) == pytest.approx(
        {2: 0.5 / 6.5, 3: 1.5 / 6.5, 4: 4.5 / 6.5}  # final 3 + 0.5 * 3
    )
    rot = EarlyExitConfig(exit_layers=[2, 3], curriculum="rotational", rotation=2)
    assert exit_weights(rot, L, 0) == pytest.approx({2: 1 / 7, 4: 6 / 7})
    assert exit_weights(rot, L, 5) == pytest.approx({3: 3 / 9, 4: 6 / 9})


def test_loss_and_gradients_match_a_hand_computation():
    """The hooks' loss (layer dropout on) equals the model run layer by layer with the same draws."""
    torch.manual_seed(0)
    batch = torch.randint(0, CFG.vocab_size, (6, 17))
    ee_cfg = EarlyExitConfig(exit_layers=[2, 3], loss_scale=0.7, layer_dropout=0.6)
    model = build_model(CFG, seed=1).train()
    hooked = EarlyExit(ee_cfg, model, max_steps=10, seed=5)
    hooked.step = 3
    total, final = hooked.loss(model(batch[:, :-1]), batch)
    total.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = build_model(CFG, seed=1).train()  # no hooks: the recipe written out
    gen = torch.Generator().manual_seed(5)
    inner, targets = ref.model, batch[:, 1:].reshape(-1)
    ce = lambda h: F.cross_entropy(ref.lm_head(inner.norm(h)).reshape(-1, CFG.vocab_size), targets)  # noqa: E731
    x = inner.embed_tokens(batch[:, :-1])
    pos = torch.arange(16).expand(6, 16)
    from baton.common.rope import rotary_cos_sin
    from baton.common.model import DenseCausalAttention

    cos, sin = rotary_cos_sin(inner.inv_freq, pos, x.dtype)
    losses, dropped = {}, []
    for l, layer in enumerate(inner.layers):
        p = 0.6 * l / (L - 1)
        out = layer(x, cos, sin, DenseCausalAttention())
        if p > 0:
            drop = torch.rand(6, generator=gen) < p
            dropped.append(drop)
            out = torch.where(drop[:, None, None], x, out)
        x = out
        losses[l + 1] = ce(x)
    w = {2: 0.7 * 1, 3: 0.7 * 3, 4: 3 + 0.7 * 3}
    expect = sum(w[e] * losses[e] for e in w) / sum(w.values())
    expect.backward()
    assert any(d.any() for d in dropped) and not all(d.all() for d in dropped)  # some samples skip, not all
    assert torch.allclose(final, losses[4], atol=1e-6)
    assert torch.allclose(total, expect, atol=1e-6)
    for n, p in ref.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-6), n
    assert set(hooked.metrics()) == {"exit2_loss", "exit3_loss"}

    model.eval()  # evaluation: the plain model, no dropout and no captured logits
    with torch.no_grad():
        assert torch.allclose(model(batch), ref.eval()(batch), atol=1e-6)
    assert not hooked.exit_logits


def recipe(tmp_path, **extra) -> dict:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PATTERN_TEXT)
    return {
        "data": {"path": str(corpus), "seq_len": 24, "val_fraction": 0.1, "cache_dir": str(tmp_path / "ds")},
        "micro_batch_size": 4,
        "max_steps": 4,
        "eval_interval": 0,
        "eval_batches": 1,
        "log_interval": 1,
        "optim": {"warmup_steps": 0},
        "logging": {"progress": False, "mfu": False, "plot": False, "tensorboard": False},
        "out_dir": str(tmp_path / "run"),
        **extra,
    }


def test_a_fine_tune_records_its_exits_in_the_handoff(tmp_path):
    tok = train_char(PATTERN_TEXT)
    base = build_model(ModelConfig(**{**CFG.to_dict(), "vocab_size": tok.vocab_size}), seed=0)
    save_model(tmp_path / "base", base, tokenizer=tok)
    raw = recipe(tmp_path, init_from=str(tmp_path / "base"), early_exit={"exit_layers": [2, 3], "layer_dropout": 0.2})
    result = train(config_from_dict(raw))
    assert math.isfinite(result.final_train_loss)
    handoff = result.handoff_dir
    assert json.loads((handoff / "config.json").read_text())["early_exit_layers"] == [2, 3]
    assert load_checkpoint(handoff).model.config.early_exit_layers == [2, 3]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("exit2_loss" in r and "exit3_loss" in r for r in logged if not r.get("skipped"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(handoff)  # transformers ignores the extra key
    ids = torch.tensor([tok.encode("the cat sat")])
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, load_checkpoint(handoff).model(ids), atol=1e-5)


@pytest.mark.parametrize(
    "section, extra, match",
    [
        ({"exit_layers": [4]}, {}, "must lie in 2..3"),
        ({"exit_layers": [1]}, {}, "must lie in 2..3"),
        ({"exit_layers": [3, 2]}, {}, "sorted"),
        ({"layer_dropout": 1.5}, {}, r"layer_dropout must be in \[0, 1\]"),
        ({"exit_layers": [2], "loss_scale": 0}, {}, "loss_scale must be a number > 0"),
        ({"curriculum": "gradual"}, {}, "curriculum must be one of"),
        ({"exit_layers": [2]}, {"backend": "deepspeed"}, "early_exit needs backend: torch"),
        ({"exits": [2]}, {}, "unknown key"),
    ],
)
def test_bad_early_exit_sections_are_refused(tmp_path, section, extra, match):
    model = {k: v for k, v in CFG.to_dict().items() if k in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
    with pytest.raises(ConfigError, match=match):
        config_from_dict(recipe(tmp_path, model=model, early_exit=section, **extra))


@pytest.mark.slow
def test_ddp_trains_the_same_exits_as_one_process(recipe, tmp_path):
    """DDP over 2 ranks: the same weights as one process with the whole global batch (the exit
    losses sit inside DDP's forward); with layer dropout on, every rank still reduces every gradient."""
    from .conftest import MULTI_RUN, final_state, max_rel_diff, run

    common = "model.num_hidden_layers=3,early_exit.exit_layers=[2],early_exit.loss_scale=2.0"
    for nproc, specs in ((1, [f"ee={common}"]), (2, [f"ee={common}", f"drop={common},early_exit.layer_dropout=0.5"])):
        run(
            nproc, [str(recipe), str(tmp_path / f"w{nproc}"), *specs], tmp_path / f"w{nproc}.log", script=str(MULTI_RUN)
        )
    one, two = final_state(tmp_path / "w1" / "ee"), final_state(tmp_path / "w2" / "ee")
    assert max_rel_diff(two.weights, one.weights) < 1e-4
    assert json.loads((tmp_path / "w2" / "drop" / "handoff" / "config.json").read_text())["early_exit_layers"] == [2]
