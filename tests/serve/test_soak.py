"""A soak against a freshly started `baton serve`: HTTP (OpenAI), gRPC and KServe at once.

The load is benchmarks/soak.py's (one definition for the suite and the long benchmark): it opens
with a burst of chat requests on the cold server (before the chat template and the grammar
compiler were built at load, that burst got HTTP 500s from transformers' first import racing in
request threads), then a few hundred mixed requests from 24 clients: sampled and seeded, n > 1,
chat and chat streams, structured output, a third of the streams dropped by the client, bad
requests. Checked: nothing but success or the expected refusal, the KV pool empty afterwards, RSS
growth after warm-up within a bound, health SERVING, the greedy answer unchanged (and equal to the
offline engine's), and exactly one request-log line and one `baton_requests` count per request.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.request
from pathlib import Path

import pytest

from .openai_fixtures import with_chat_template
from .server_fixtures import offline

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
REQUESTS, WARMUP, CLIENTS, BURST = 300, 100, 24, 48
RSS_GROWTH_MIB = 48  # after warm-up; a leak of a few KB per request over 200 requests stays far below


def _load_soak():
    spec = importlib.util.spec_from_file_location("soak_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_fresh_server_under_concurrent_load_on_every_api(llama_dir, tmp_path):
    soak = _load_soak()
    ckpt = with_chat_template(llama_dir, tmp_path / "ckpt")
    log = tmp_path / "serve.log"
    proc, target, http_port, metrics_url = soak.start_server(ckpt, log, ["--num-kv-blocks", "256", "--block-size", "8"])
    try:
        greedy_before = soak.greedy(target)  # gRPC: touches neither the chat template nor the grammar compiler
        kinds = soak.schedule(REQUESTS, BURST)
        results = soak.run_load(http_port, target, "soak", kinds[:WARMUP], CLIENTS, BURST)
        assert soak.wait_kv_idle(metrics_url) == 0
        rss_warm = soak.rss_mib(proc.pid)
        results += soak.run_load(http_port, target, "soak", kinds[WARMUP:], CLIENTS, 0)
        kv_used = soak.wait_kv_idle(metrics_url)
        rss_end = soak.rss_mib(proc.pid)
        with soak.BatonClient(target, timeout=30) as c:
            health = c.health()
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=30) as resp:
            http_health = (resp.status, json.loads(resp.read())["status"])
        greedy_after = soak.greedy(target)
        requests_metric = sum(v for k, v in soak.metrics(metrics_url).items() if k.startswith("baton_requests_total"))
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()[-3000:]

    failures = [r for r in results if r.outcome not in ("ok", "refused")]
    assert not failures, f"{len(failures)} of {len(results)} requests failed, e.g. {failures[:5]}"
    assert len(results) == REQUESTS
    assert sum(r.kind in soak.BAD for r in results) == sum(r.outcome == "refused" for r in results) > 0
    assert kv_used == 0, "KV blocks still in use after every request ended"
    assert rss_end - rss_warm < RSS_GROWTH_MIB, (rss_warm, rss_end)
    assert (health, http_health) == ("SERVING", (200, "serving"))
    reference = offline(ckpt, [soak.PROMPTS[0]], soak.MAX_TOKENS)[0][0]
    assert greedy_before == greedy_after == reference
    logged = soak.requests_logged(log.read_text())
    assert sum(logged.values()) == REQUESTS + 2 == requests_metric, logged  # + the two greedy calls
    assert "internal" not in logged and "unavailable" not in logged, logged
