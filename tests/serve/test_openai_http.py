"""The OpenAI-compatible HTTP front, spoken to by the official `openai` client (unmodified).

Reference for every output: the offline engine (serve/llm.py LLM) on the same prompts, and HF
transformers' logits for the logprobs. The server runs in-process (uvicorn on a loopback port);
tests/serve/test_openai_cli.py runs the real `baton serve --http-port` subprocess.
"""

from __future__ import annotations

import json
import socket

import openai
import pytest
import torch
import transformers

from baton.serve.engine import EngineConfig
from baton.serve.llm import LLM
from baton.serve.sampling_params import SamplingParams

from .openai_fixtures import with_chat_template
from .server_fixtures import PROMPTS, ServerThread

GREEDY = dict(temperature=0, max_tokens=10)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
RENDERED = "<system>Be brief.<|endoftext|><user>The quick brown fox<|endoftext|><assistant>"  # by hand


@pytest.fixture(scope="module")
def model_dir(llama_dir, tmp_path_factory):
    return with_chat_template(llama_dir, tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture(scope="module")
def server(model_dir):
    s = ServerThread(model_dir, num_kv_blocks=128, http_port=0, limits=_limits())
    yield s
    s.stop()


def _limits():
    from baton.serve.runtime import Limits

    return Limits(max_output_tokens=64, max_n=4)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, EngineConfig(num_kv_blocks=256, block_size=8))


@pytest.fixture(scope="module")
def hf(llama_dir):
    """The HF model the checkpoint was imported from: the logprob reference."""
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir.parent / "hf-llama").float().eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_completions_greedy_equal_the_offline_engine(client, llm):
    prompts = PROMPTS[:4]
    ref = llm.generate(prompts, SamplingParams(**GREEDY))
    r = client.completions.create(model="tiny", prompt=prompts, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref]
    assert [c.finish_reason for c in r.choices] == [o.outputs[0].finish_reason for o in ref]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in ref)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # streaming: the pieces add up to the same text; the usage chunk comes last, choices empty
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompts[0], stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks[:-1]) == ref[0].outputs[0].text
    assert chunks[-2].choices[0].finish_reason == ref[0].outputs[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref[0].outputs[0].token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    # token-id prompts (what lm-eval sends) give the same as their text
    ids = llm.engine.tokenizer.encode(prompts[1])
    assert client.completions.create(model="tiny", prompt=ids, **GREEDY).choices[0].text == ref[1].outputs[0].text


def test_chat_renders_the_checkpoints_template(client, llm, model_dir):
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf_ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert hf_ids == RENDERED
    ref = llm.generate(RENDERED, SamplingParams(**GREEDY))[0]
    assert llm.chat(MESSAGES, SamplingParams(**GREEDY))[0].outputs[0].token_ids == ref.outputs[0].token_ids
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    choice = r.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant",
        ref.outputs[0].text,
        ref.outputs[0].finish_reason,
    )
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) == len(hf_tok(RENDERED)["input_ids"])
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # max_completion_tokens wins over max_tokens, as in OpenAI's API
    short = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=10, max_completion_tokens=3
    )
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_n_and_seed_reproduce_and_equal_the_offline_engine(client, llm):
    kw = dict(model="tiny", prompt=PROMPTS[0], n=3, temperature=1.0, seed=1234, max_tokens=8, logprobs=0)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    ref = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8))[0]
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == [c.text for c in ref.outputs]
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)
    other = client.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    chat = dict(model="tiny", messages=MESSAGES, n=2, temperature=1.0, seed=5, max_tokens=6)
    x, y = client.chat.completions.create(**chat), client.chat.completions.create(**chat)
    assert [c.message.content for c in x.choices] == [c.message.content for c in y.choices]
    ref = llm.chat(MESSAGES, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6))[0]
    assert [c.message.content for c in x.choices] == [c.text for c in ref.outputs]


def test_stop_strings_end_the_text_as_offline(client, llm):
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].text
    stop = full[5:7]
    assert stop and stop.strip()
    ref = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], temperature=0, max_tokens=24, stop=stop)
    assert r.choices[0].text == ref.outputs[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    chat_ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24, stop=[stop, "zz"]))[0].outputs[0]
    c = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=24, stop=[stop, "zz"])
    assert (c.choices[0].message.content, c.choices[0].finish_reason) == (chat_ref.text, chat_ref.finish_reason)


def test_logprobs_equal_hf_transformers(client, llm, hf):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], logprobs=3, echo=True, **GREEDY)
    lp = r.choices[0].logprobs
    prompt_ids = llm.engine.tokenizer.encode(PROMPTS[0])
    out_ids = llm.generate(PROMPTS[0], SamplingParams(**GREEDY))[0].outputs[0].token_ids
    ref = hf_logprobs(hf, prompt_ids + out_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:], dtype=torch.double), ref, atol=1e-4, rtol=0)
    assert len(lp.tokens) == len(prompt_ids) + r.usage.completion_tokens
    assert r.choices[0].text.startswith(PROMPTS[0])
    for chosen, top in zip(lp.token_logprobs[len(prompt_ids) :], lp.top_logprobs[len(prompt_ids) :]):
        # keyed by text, so pieces that decode alike (partial UTF-8 -> U+FFFD) share a key, as in OpenAI's API
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(chosen)  # greedy: chosen is the top
    c = client.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    content = c.choices[0].logprobs.content
    chat_ids = llm.engine.tokenizer.encode(RENDERED)
    chat_out = llm.generate(RENDERED, SamplingParams(**GREEDY))[0].outputs[0].token_ids
    ref = hf_logprobs(hf, chat_ids + chat_out)[len(chat_ids) - 1 :]
    torch.testing.assert_close(torch.tensor([t.logprob for t in content], dtype=torch.double), ref, atol=1e-4, rtol=0)
    assert len(content) == c.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob and bytes(t.bytes) == t.token.encode()


def _close(got: dict[str, float], want: dict[int, float]) -> bool:
    """A top_logprobs dict (keyed by text) holds only values of the offline engine's (keyed by id)."""
    return all(any(abs(v - w) < 1e-5 for w in want.values()) for v in got.values())


def test_streamed_logprobs_equal_non_streamed_and_offline(client, llm):
    """Each stream chunk carries its new tokens' logprobs: joined, they equal the non-streamed
    response's and the offline engine's, and the usage chunk counts the tokens the chunks carried."""
    tok = llm.engine.tokenizer
    ref = llm.generate(PROMPTS[1], SamplingParams(logprobs=2, **GREEDY))[0].outputs[0]
    ref_lp = [lp[t] for t, lp in zip(ref.token_ids, ref.logprobs)]
    kw = dict(model="tiny", prompt=PROMPTS[1], logprobs=2, **GREEDY)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    parts = [c.choices[0].logprobs for c in chunks[:-1] if c.choices[0].logprobs is not None]
    fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    got = {f: [x for p in parts for x in getattr(p, f)] for f in fields}
    assert got["text_offset"] == whole.text_offset  # offsets into the whole text, not restarting each chunk
    assert got["tokens"] == whole.tokens == [tok.decode([t]) for t in ref.token_ids]
    assert got["token_logprobs"] == pytest.approx(whole.token_logprobs, abs=1e-6)
    assert got["token_logprobs"] == pytest.approx(ref_lp, abs=1e-5)
    assert [pytest.approx(t, abs=1e-6) for t in whole.top_logprobs] == got["top_logprobs"]
    for top, chosen, want in zip(got["top_logprobs"], ref_lp, ref.logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(chosen, abs=1e-5) and _close(top, want)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(got["tokens"]) == len(ref_lp)

    ref = llm.generate(RENDERED, SamplingParams(logprobs=2, **GREEDY))[0].outputs[0]
    ref_lp = [lp[t] for t, lp in zip(ref.token_ids, ref.logprobs)]
    kw = dict(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    got = [t for c in chunks[:-1] if c.choices[0].logprobs is not None for t in c.choices[0].logprobs.content]
    assert [t.token for t in got] == [t.token for t in whole] == [tok.decode([t]) for t in ref.token_ids]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in whole], abs=1e-6)
    assert [t.logprob for t in got] == pytest.approx(ref_lp, abs=1e-5)
    for t, w, want in zip(got, whole, ref.logprobs):
        assert [a.token for a in t.top_logprobs] == [a.token for a in w.top_logprobs]
        assert [a.logprob for a in t.top_logprobs] == pytest.approx([a.logprob for a in w.top_logprobs], abs=1e-6)
        assert len(t.top_logprobs) == 2 and _close({a.token: a.logprob for a in t.top_logprobs}, want)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(got) == len(ref_lp)


def test_models_and_health(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].owned_by == "baton"
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.http_port}/health") as resp:
        assert resp.status == 200 and json.load(resp) == {"status": "serving"}
        # Nagle off on the server's side of every connection, or each SSE event waits for a delayed ACK
        conns = server.server._http._server.server_state.connections
        assert conns and all(
            c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in conns
        )
