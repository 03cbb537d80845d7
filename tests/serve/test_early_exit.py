"""CALM confidence early exit: the engine's tokens and logprobs equal a token-by-token plain-PyTorch
reference that applies the same rule (exit at the first recorded exit whose softmax max >= t; the
skipped layers' K/V computed from the exit state), over mixed-length prompts arriving at different
steps; a reference with another fill rule disagrees, so the test sees the fill."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.common.checkpoint import load_checkpoint, save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.speculative import SpeculativeConfig

from .conftest import run_staggered

CFG = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,  # peaked exit distributions: some tokens pass the threshold, some do not
    early_exit_layers=[1, 2],
)
THRESHOLD = 0.3
NEW = 14


def rotate(x: torch.Tensor, p: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE at position p (rotate-half convention), x [heads, head_dim]."""
    emb = torch.cat([p * inv_freq, p * inv_freq])
    x1, x2 = x.chunk(2, -1)
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


@torch.no_grad()
def reference(model, prompt: list[int], n: int, threshold: float, fill: str = "exit-state"):
    """Greedy decoding one token at a time with a K/V list per layer. A generated token fed back may
    leave at an exit; its skipped layers' K/V come from the exit hidden state ("exit-state", CALM),
    or are left out ("none": later tokens cannot see it there). Returns (tokens, log-softmax rows, exits)."""
    inner, c = model.model, model.config
    nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    inv_freq = inner.inv_freq
    keys, values = [[] for _ in inner.layers], [[] for _ in inner.layers]

    def kv(layer, h, p):
        a, x = layer.self_attn, layer.input_layernorm(h)
        return rotate(a.k_proj(x).view(nkv, d), p, inv_freq), a.v_proj(x).view(nkv, d)

    def run_layer(i, layer, h, p):
        a, x = layer.self_attn, layer.input_layernorm(h)
        q = rotate(a.q_proj(x).view(nh, d), p, inv_freq)
        k, v = kv(layer, h, p)
        keys[i].append(k)
        values[i].append(v)
        ks = torch.stack(keys[i]).repeat_interleave(nh // nkv, 1)  # [P, nh, d]
        vs = torch.stack(values[i]).repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("hd,phd->hp", q, ks) * d**-0.5, -1)
        h = h + a.o_proj(torch.einsum("hp,phd->hd", att, vs).reshape(-1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def head(h):
        return torch.log_softmax(model.lm_head(inner.norm(h)).float(), -1)

    tokens, rows, exits = list(prompt), [], []
    for p in range(len(prompt) + n - 1):
        h = inner.embed_tokens(torch.tensor(tokens[p]))
        may_exit = p >= len(prompt)  # a generated token fed back (the prompt runs full depth)
        for i, layer in enumerate(inner.layers):
            if may_exit and i in c.early_exit_layers and head(h).exp().max() >= threshold:
                exits.append(i)
                for j in range(i, len(inner.layers)):
                    if fill == "exit-state":
                        k, v = kv(inner.layers[j], h, p)
                    else:  # a wrong rule: zeros
                        k, v = torch.zeros(nkv, d), torch.zeros(nkv, d)
                    keys[j].append(k)
                    values[j].append(v)
                break
            h = run_layer(i, layer, h, p)
        else:
            if may_exit:
                exits.append(len(inner.layers))
        if p >= len(prompt) - 1:
            rows.append(head(h))
            tokens.append(int(rows[-1].argmax()))
    return tokens[len(prompt) :], rows, exits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("calm")
    save_model(d, build_model(CFG, seed=3))
    return d


@pytest.fixture(scope="module")
def refs(checkpoint):
    """Mixed-length prompts and the reference's (tokens, log-softmax rows, exits) for each."""
    model = load_checkpoint(checkpoint).model
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (3, 21, 9, 12)]
    return prompts, [reference(model, p, NEW, THRESHOLD) for p in prompts]


def test_logits_equal_the_token_by_token_reference(checkpoint, refs):
    model = load_checkpoint(checkpoint).model
    prompts, refs = refs
    exits = [e for _, _, ex in refs for e in ex]
    assert {1, 2, 4} <= set(exits), exits  # tokens leave at each exit, and some go the whole depth

    engine = LLMEngine.from_checkpoint(
        checkpoint, EngineConfig(num_kv_blocks=64, block_size=8, early_exit_threshold=THRESHOLD)
    )
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    outs = {}
    pending, step = list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:  # arriving at different steps: decodes beside prefills
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in engine.step():
            if out.finished:
                outs[int(out.request_id)] = out.outputs[0]
        step += 1
    for i, (tokens, rows, _) in enumerate(refs):
        assert outs[i].token_ids == tokens, i
        for got, want in zip(outs[i].logprobs, rows):
            top = torch.topk(want, 5)
            assert sorted(got) == sorted(top.indices.tolist())
            for tok, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(got[tok] - lp) < 1e-4
    counted = engine.early_exit.exits
    assert sum(counted.values()) == len(exits) and counted[1] == exits.count(1)

    # The fill matters: leaving the skipped layers' K/V out changes later tokens' logits.
    wrong = [reference(model, p, NEW, THRESHOLD, fill="none")[1] for p in prompts]
    assert any(not torch.allclose(a, b, atol=1e-3) for r, w in zip(refs, wrong) for a, b in zip(r[1], w))


def test_the_server_reports_the_exits_the_reference_took(checkpoint, refs):
    """ServerInfo and /metrics count the decode tokens by the depth they ran: the reference's exits."""
    import urllib.request
    from collections import Counter

    from prometheus_client.parser import text_string_to_metric_families

    from baton.serve.client import BatonClient

    from .server_fixtures import ServerThread

    prompts, refs = refs
    s = ServerThread(checkpoint, engine_extra={"early_exit_threshold": THRESHOLD})
    try:
        with BatonClient(s.target, timeout=60) as c:
            for prompt, (tokens, _, _) in zip(prompts, refs):
                out = c.complete(prompt, max_tokens=NEW, temperature=0, ignore_eos=True)
                assert list(out.completions[0].token_ids) == tokens
            info = c.server_info()
        url = f"http://127.0.0.1:{s.server.metrics_port}/metrics"
        fams = {
            f.name: f for f in text_string_to_metric_families(urllib.request.urlopen(url, timeout=10).read().decode())
        }
    finally:
        s.stop()
    want = Counter(e for _, _, exits in refs for e in exits)
    assert list(info.early_exit_layers) == [1, 2, CFG.num_hidden_layers]
    assert list(info.early_exit_tokens) == [want[1], want[2], want[CFG.num_hidden_layers]]
    assert sum(info.early_exit_tokens) == len(prompts) * (NEW - 1)  # every fed-back token, none twice
    on_metrics = {x.labels["layers"]: x.value for x in fams["baton_early_exit_tokens"].samples}
    assert on_metrics == {str(e): want[e] for e in (1, 2, CFG.num_hidden_layers)}
    assert info.spec_method == "none" and info.spec_speedup == 0


def test_threshold_one_is_full_depth_decoding(checkpoint):
    """No token is that sure: the output is plain greedy decoding's."""
    prompt = list(range(5, 17))
    plain = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_kv_blocks=32, block_size=8))
    calm = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_kv_blocks=32, block_size=8, early_exit_threshold=1.0))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert run_staggered(calm, [prompt], params) == run_staggered(plain, [prompt], params)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"early_exit_threshold": 0.0}, r"must be in \(0, 1\]"),
        ({"speculative": SpeculativeConfig("ngram")}, "cannot be combined with speculative"),
        ({"kv_cache_dtype": "int8"}, "unquantized"),
    ],
)
def test_bad_combinations_are_refused(checkpoint, change, words):
    cfg = dataclasses.replace(EngineConfig(num_kv_blocks=16, early_exit_threshold=0.5), **change)
    with pytest.raises(ValueError, match=words):
        LLMEngine.from_checkpoint(checkpoint, cfg)


def test_a_checkpoint_without_exits_is_refused_before_serving(tmp_path, monkeypatch, capsys):
    import baton.serve.server as server_module
    from baton.common.cli import main

    save_model(tmp_path, build_model(dataclasses.replace(CFG, early_exit_layers=None), seed=0))
    seen = []
    monkeypatch.setattr(server_module, "run", lambda config: seen.append(config) or 0)
    assert main(["serve", "--model", str(tmp_path), "--early-exit-threshold", "0.5"]) == 2
    assert "recorded early exits" in capsys.readouterr().err and not seen
