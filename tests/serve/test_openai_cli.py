"""`baton serve --http-port`: the real subprocess, vLLM's flag names, and the drain on SIGTERM
(an in-flight stream finishes with [DONE], new calls get 503, exit 0)."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time

import openai
import pytest

import baton.serve.server as server_module
from baton.common.cli import main

from .server_fixtures import ServerProcess


@pytest.fixture
def served(monkeypatch):
    seen = []
    monkeypatch.setattr(server_module, "run", lambda config: seen.append(config) or 0)
    return seen


def test_vllm_flag_names_reach_the_config(served, tmp_path):
    argv = ["serve", "--model", str(tmp_path), "--served-model-name", "m1", "--http-port", "0"]
    argv += ["--max-num-batched-tokens", "77", "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]
    assert main(argv) == 0
    c = served[0]
    assert (c.model_name, c.http_port) == ("m1", 0)
    assert (c.engine.scheduler.max_num_batched_tokens, c.engine.enable_prefix_caching) == (77, False)
    assert c.engine.scheduler.enable_chunked_prefill is False
    assert main(["serve", "--model", str(tmp_path), "--model-name", "m2", "--enable-chunked-prefill"]) == 0
    assert (served[1].model_name, served[1].http_port, served[1].engine.scheduler.enable_chunked_prefill) == (
        "m2",
        None,  # off by default
        True,
    )


def _stream_lines(port: int, body: dict, lines: list, started: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    lines.append(resp.status)
    while line := resp.readline():
        if line.strip():
            lines.append(line.strip())
            started.set()
    conn.close()


@pytest.mark.slow
def test_baton_serve_http_subprocess_drains_on_sigterm(llama_dir, tmp_path):
    proc = ServerProcess(
        tmp_path,
        "--model",
        str(llama_dir),
        "--http-port",
        "0",
        "--served-model-name",
        "tiny-http",
        "--num-kv-blocks",
        "64",
        "--block-size",
        "8",
        "--max-num-batched-tokens",
        "64",
        "--drain-timeout",
        "300",  # the in-flight stream must end by itself, however loaded the machine
    )
    try:
        port = int(re.search(r"http=[\d.]+:(\d+)", proc.log())[1])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-http"]
        r = client.completions.create(model="tiny-http", prompt="The quick", max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop") and 1 <= r.usage.completion_tokens <= 4
        lines, started = [], threading.Event()
        body = {"model": "tiny-http", "prompt": "The", "max_tokens": 60, "ignore_eos": True, "stream": True}
        t = threading.Thread(target=_stream_lines, args=(port, body, lines, started))
        t.start()
        assert started.wait(60)
        proc.proc.send_signal(__import__("signal").SIGTERM)
        deadline = time.monotonic() + 30
        while "draining" not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # the port stays open while draining
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x"}), {"Content-Type": "application/json"})
        refused = conn.getresponse()
        assert refused.status == 503 and "shutting down" in json.loads(refused.read())["error"]["message"]
        t.join(120)
        assert proc.terminate() == 0
        assert lines[0] == 200 and lines[-1] == b"data: [DONE]"
        last = json.loads(lines[-2].removeprefix(b"data: "))
        assert last["choices"][0]["finish_reason"] == "length"
        text = "".join(json.loads(x.removeprefix(b"data: "))["choices"][0]["text"] for x in lines[1:-1])
        assert text  # the in-flight stream ran to its end through the drain
    finally:
        proc.terminate()
