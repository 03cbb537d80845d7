"""`baton train` with a `router:` recipe: bad recipes fail with a ConfigError naming the problem
before anything loads, and a good one (classifier or kNN) writes a router that the serving side's
loader reads back and that sorts three easy kinds of prompt well above chance."""

from __future__ import annotations

import json

import pytest
import yaml

from baton.common.checkpoint import save_model
from baton.common.cli import main as baton
from baton.common.config import ConfigError, ModelConfig
from baton.common.model import build_model
from baton.common.router import load_router
from baton.common.tokenizer import train_bpe
from baton.train.recipe import load_recipe
from baton.train.router import RouterTrainConfig

WORDS = ["alpha beta gamma delta", "one two three four", "red green blue black"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    tok = train_bpe([" ".join(WORDS) * 20], vocab_size=300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    base = save_model(tmp / "base", build_model(cfg, seed=0), tokenizer=tok)
    rows = [{"text": f"{w} {i}", "expert": f"e{k}"} for i in range(20) for k, w in enumerate(WORDS)]
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp, base, data


def recipe(tmp, body: dict, name: str = "r.yaml"):
    (tmp / name).write_text(yaml.safe_dump(body))
    return tmp / name


def test_bad_router_recipes_fail_before_any_work(setup):
    tmp, base, data = setup
    good = {"base": str(base), "data": str(data), "out": str(tmp / "out")}
    (tmp / "one.jsonl").write_text(json.dumps({"text": "x", "expert": "a"}) + "\n")
    (tmp / "broken.jsonl").write_text('{"text": "x"}\n')
    cases = {
        "is not a checkpoint directory": {**good, "base": str(tmp / "nowhere")},
        "kind must be one of": {**good, "kind": "forest"},
        "needs at least two": {**good, "data": str(tmp / "one.jsonl")},
        r"broken.jsonl:1: each line must be": {**good, "data": str(tmp / "broken.jsonl")},
        "unknown key": {**good, "layers": 3},
        "does not exist": {**good, "val_path": str(tmp / "missing.jsonl")},
    }
    for message, body in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_recipe(recipe(tmp, {"router": body}))
    with pytest.raises(ConfigError, match="unknown key"):
        load_recipe(recipe(tmp, {"router": good, "data": {"path": "x"}}))
    assert isinstance(load_recipe(recipe(tmp, {"router": good})), RouterTrainConfig)


@pytest.mark.parametrize("kind", ["classifier", "knn"])
def test_baton_train_writes_a_router_the_server_side_loads(setup, kind, capsys):
    tmp, base, data = setup
    out = tmp / f"out-{kind}"
    body = {"base": str(base), "data": str(data), "out": str(out), "kind": kind, "val_fraction": 0.25, "k": 3}
    assert baton(["train", "--config", str(recipe(tmp, {"router": body}, f"{kind}.yaml"))]) == 0
    assert f"Router ({kind}, experts e0, e1, e2)" in capsys.readouterr().out
    router = load_router(out)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    picks = router.route([r["text"] for r in rows])
    accuracy = sum(p == r["expert"] for (p, _), r in zip(picks, rows)) / len(rows)
    assert router.config.experts == ["e0", "e1", "e2"] and accuracy > 0.9  # three easy kinds; chance 1/3
    assert all(0 < c <= 1 for _, c in picks)
