"""The HTTP front's refusals: every bad input gets OpenAI's error JSON with the right status (and
names the parameter), auth, 429 over the queue limit, 503 while loading; the server keeps serving.
Also response_format (structured outputs) through the official client, and SSE framing byte for byte."""

from __future__ import annotations

import http.client
import json
import math
import re
import threading
import time

import jsonschema
import openai
import pytest

from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.llm import LLM
from baton.serve.runtime import Limits
from baton.serve.sampling_params import SamplingParams

from .openai_fixtures import with_chat_template
from .server_fixtures import ServerThread

BAD = [  # (path, body, status, param)
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 9}, 400, "n"),  # over --max-n
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),  # over --max-output-tokens
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 40}, 400, "stop"),  # over --max-stop-strings
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"prompt": "x" * 2000}, 400, "prompt"),  # longer than the context
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99},
        400,
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400, "tools[0].type"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
]


@pytest.fixture(scope="module")
def model_dir(llama_dir, tmp_path_factory):
    return with_chat_template(llama_dir, tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture(scope="module")
def server(model_dir):
    limits = Limits(max_output_tokens=64, max_n=4, max_concurrent=1, max_queued=0, max_message_bytes=64 * 2**10)
    s = ServerThread(model_dir, num_kv_blocks=128, http_port=0, auth_token="s3cret", limits=limits)
    yield s
    s.stop()


def request(port: int, method: str, path: str, body=None, token: str | None = "s3cret", raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp, payload


def error_of(payload: bytes) -> dict:
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_every_bad_input_is_refused_with_its_status_and_the_server_goes_on(server, caplog):
    """... and each refusal writes exactly one request-log line, with the outcome its status means."""
    caplog.set_level("INFO", logger="baton.serve.requests")
    outcome = {400: "invalid_argument", 404: "not_found", 413: "resource_exhausted"}

    def one_line(status: int, why) -> str:
        lines = [r.getMessage() for r in caplog.records if "outcome=" in r.getMessage()]
        assert len(lines) == 1 and f"outcome={outcome[status]}" in lines[0], (why, lines)
        caplog.clear()
        return lines[0]

    port = server.server.http_port
    for path, body, status, param in BAD:
        body = {"model": "tiny", **body} if "model" not in body else body
        resp, payload = request(port, "POST", path, body)
        assert resp.status == status, (body, payload)
        err = error_of(payload)
        assert err["param"] == param, (body, err)
        one_line(status, body)
    resp, payload = request(port, "POST", "/v1/completions", raw=b'{"prompt": ')  # not JSON
    assert resp.status == 400 and error_of(payload)["type"] == "invalid_request_error"
    assert one_line(400, "not JSON").endswith("error=RequestValidationError")
    big = json.dumps({"model": "tiny", "prompt": "x" * 100_000}).encode()  # over --max-message-mb
    resp, payload = request(port, "POST", "/v1/completions", raw=big)
    assert resp.status == 413 and error_of(payload)["code"] == "request_too_large"
    one_line(413, "too large")
    resp, payload = request(port, "GET", "/v1/nothing-here")
    assert resp.status == 404 and error_of(payload)
    resp, _ = request(port, "POST", "/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 3})
    assert resp.status == 200


def test_auth_token_is_required_except_for_health(server):
    port = server.server.http_port
    base = f"http://127.0.0.1:{port}/v1"
    for token in (None, "wrong"):
        resp, payload = request(port, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"}, token=token)
        assert resp.status == 401 and error_of(payload)["type"] == "authentication_error"
        assert resp.getheader("WWW-Authenticate") == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in openai.OpenAI(base_url=base, api_key="s3cret").models.list().data] == ["tiny"]
    resp, payload = request(port, "GET", "/health", token=None)
    assert resp.status == 200 and json.loads(payload) == {"status": "serving"}


def test_over_the_queue_limit_is_429_and_the_server_goes_on(server):
    """max_concurrent=1, max_queued=0: a second call while one streams is refused at once."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="s3cret", max_retries=0)
    stream = client.completions.create(
        model="tiny", prompt="The", max_tokens=30, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))  # the stream holds the one slot now
    assert first.choices
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "server_full"
    assert sum(len(c.choices[0].text) >= 0 for c in stream) >= 1  # finishes normally
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].finish_reason


def test_loading_is_503_until_the_model_is_attached_and_chat_needs_a_template(llama_dir):
    """llama_dir's tokenizer_config.json has no chat_template: chat is a clear 400, completions work."""
    model_dir = llama_dir
    from baton.serve.async_engine import AsyncLLMEngine
    from baton.serve.server import BatonServer, ServerConfig

    s = ServerThread.__new__(ServerThread)  # the loop thread only; load() is run by hand below
    s.loop = __import__("asyncio").new_event_loop()
    s.thread = threading.Thread(target=s.loop.run_forever, daemon=True)
    s.thread.start()
    s.server = BatonServer(ServerConfig(model=str(model_dir), port=0, metrics_port=None, http_port=0))
    s.server._engine = AsyncLLMEngine(
        LLMEngine.from_checkpoint(model_dir, EngineConfig(num_kv_blocks=32, block_size=8))
    )
    s.run(s.server.start())
    port = s.server.http_port
    try:
        resp, payload = request(port, "POST", "/v1/completions", {"prompt": "x"}, token=None)
        assert resp.status == 503 and "loading" in error_of(payload)["message"]
        assert request(port, "GET", "/health", token=None)[0].status == 503
        s.run(s.server.load())
        assert request(port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, token=None)[0].status == 200
        assert request(port, "GET", "/health", token=None)[0].status == 200
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        resp, payload = request(port, "POST", "/v1/chat/completions", chat, token=None)
        err = error_of(payload)
        assert resp.status == 400 and err["param"] == "messages" and "no chat_template" in err["message"]
        with pytest.raises(ValueError, match="no chat_template"):
            LLM(model_dir, EngineConfig(num_kv_blocks=16, block_size=8)).chat(chat["messages"])
    finally:
        s.stop()


def test_a_client_that_hangs_up_frees_its_request(server, caplog):
    """Closing the connection mid-stream aborts the engine request (its slot and KV blocks free)."""
    caplog.set_level("INFO", logger="baton.serve.requests")
    port = server.server.http_port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "tiny", "prompt": "The", "max_tokens": 60, "ignore_eos": True, "stream": True}
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(body),
        {"Authorization": "Bearer s3cret", "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()
    engine = server.server.rt.async_engine
    deadline = time.monotonic() + 30
    while (
        server.server.rt.admission.active or engine.engine.has_unfinished_requests()
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.server.rt.admission.active == 0 and not engine.engine.has_unfinished_requests()
    assert any("outcome=cancelled" in r.getMessage() for r in caplog.records)  # aborted, not run to its end
    r = request(port, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r[0].status == 200


def test_response_format_constrains_the_output(server):
    """Sampled at temperature 1: every finished output parses and validates (the tiny model alone
    would emit byte soup)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="s3cret", max_retries=0)
    schema = {
        "type": "object",
        "properties": {"c": {"enum": ["a", "bb"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["c", "n"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Give JSON."}]
    finished = 0
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=1.0,
            seed=seed,
            max_tokens=24,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
        )
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
            finished += 1
        r = client.completions.create(
            model="tiny",
            prompt="{",
            temperature=1.0,
            seed=seed,
            max_tokens=24,
            extra_body={"response_format": {"type": "json_object"}},  # vLLM's extension of completions
        )
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].text), dict)
            finished += 1
    assert finished >= 3
    r = client.completions.create(  # vLLM's structured_outputs extra: a regex
        model="tiny",
        prompt="x",
        temperature=1.0,
        seed=1,
        max_tokens=16,
        logprobs=5,  # more than the grammar allows after the "-": the masked rest is -inf, sent as -9999.0
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-(yes|no)"}},
    )
    assert re.fullmatch("[0-9]{3}-(yes|no)", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    tops = [v for top in r.choices[0].logprobs.top_logprobs for v in top.values()]
    assert -9999.0 in tops and all(math.isfinite(v) and v >= -9999.0 for v in tops)
    with pytest.raises(openai.BadRequestError) as e:  # a schema the grammar library rejects
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )
    assert e.value.body["param"] == "response_format"


def _expected_sse(model_dir, prompt: str, max_tokens: int, rid: str, created: int) -> bytes:
    """The stream OpenAI's format gives for the offline engine's step-by-step outputs."""
    engine = LLMEngine.from_checkpoint(model_dir, EngineConfig(num_kv_blocks=32, block_size=8))
    engine.add_request("ref", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    head = {"id": rid, "object": "text_completion", "created": created, "model": "tiny"}
    events, usage = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            if c.delta_token_ids or c.delta_text or c.finish_reason:
                choice = {"index": 0, "text": c.delta_text, "logprobs": None, "finish_reason": c.finish_reason}
                events.append({**head, "choices": [choice], "usage": None})
            if out.finished:
                p, n = len(out.prompt_token_ids), len(c.token_ids)
                usage = {
                    "prompt_tokens": p,
                    "completion_tokens": n,
                    "total_tokens": p + n,
                    "prompt_tokens_details": {"cached_tokens": 0},
                }
    events.append({**head, "choices": [], "usage": usage})
    data = [b"data: " + json.dumps(e, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n" for e in events]
    return b"".join(data) + b"data: [DONE]\n\n"


def test_sse_framing_byte_for_byte(server, model_dir):
    body = {"model": "tiny", "prompt": "café 🦊", "max_tokens": 6, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    resp, payload = request(server.server.http_port, "POST", "/v1/completions", body)
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    first = json.loads(payload.split(b"\n\n", 1)[0].removeprefix(b"data: "))
    assert first["id"].startswith("cmpl-")
    assert payload == _expected_sse(model_dir, body["prompt"], 6, first["id"], first["created"])


def test_a_chat_template_that_refuses_the_messages_is_bad_input(llama_dir, tmp_path):
    """A template's raise_exception (e.g. "roles must alternate") is the client's error (HTTP 400 on
    the server, as every ValueError naming messages), not an internal one."""
    refusing = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role here') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    llm = LLM(with_chat_template(llama_dir, tmp_path / "ckpt", refusing), EngineConfig(num_kv_blocks=16, block_size=8))
    with pytest.raises(ValueError, match="^messages: the checkpoint's chat template refused them: no system role here"):
        llm.chat([{"role": "system", "content": "x"}])
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
