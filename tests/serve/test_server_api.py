"""Baton's gRPC API on an in-process server: outputs equal the offline engine's, cancellation and
deadlines free the KV cache, limits hold, draining refuses new work, metrics add up."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.common.tokenizer import Tokenizer
from baton.serve.client import BatonClient
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.runtime import Limits
from baton.serve.sampling_params import SamplingParams

from .server_fixtures import PROMPTS, ServerThread, offline


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir, limits=Limits(max_concurrent=3, max_queued=2))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with BatonClient(server.target, timeout=60) as c:
        yield c


def wait_idle(client: BatonClient, timeout: float = 5.0):
    """ServerInfo once nothing is in flight (cancellation reaches the engine asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.server_info()
        if (info.engine_requests, info.active_calls, info.queued_calls) == (0, 0, 0) or time.monotonic() > deadline:
            return info


def test_stream_and_unary_equal_offline_greedy(llama_dir, client):
    prompts = PROMPTS[:4]
    ref = offline(llama_dir, prompts, max_tokens=20)
    for prompt, (ids, text, reason) in zip(prompts, ref):
        msgs = list(client.generate(prompt, max_tokens=20, temperature=0))
        assert [m.finished for m in msgs] == [False] * (len(msgs) - 1) + [True]
        got_ids = [t for m in msgs for t in m.completions[0].token_ids]
        assert got_ids == ids, prompt
        assert "".join(m.completions[0].text for m in msgs) == text
        assert msgs[-1].completions[0].finish_reason == reason
        assert msgs[-1].usage.completion_tokens == len(ids)
        whole = client.complete(prompt, max_tokens=20, temperature=0)
        assert (list(whole.completions[0].token_ids), whole.completions[0].text) == (ids, text)
    tok = Tokenizer.from_dir(llama_dir)
    by_ids = client.complete(tok.encode(prompts[0]), max_tokens=20, temperature=0)
    assert list(by_ids.completions[0].token_ids) == ref[0][0]


def test_sampling_options_pass_through(client):
    a = client.complete("The quick", max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=2)
    b = client.complete("The quick", max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=2)
    assert [list(c.token_ids) for c in a.completions] == [list(c.token_ids) for c in b.completions]
    assert len(a.completions) == 2
    for c in a.completions:
        assert len(c.logprobs) == len(c.token_ids)
        for tid, lp in zip(c.token_ids, c.logprobs):
            assert tid in lp.logprobs and all(v <= 0 for v in lp.logprobs.values())
    free = list(client.complete("The quick", max_tokens=30, temperature=0, ignore_eos=True).completions[0].token_ids)
    stop_id = free[2]
    at = free.index(stop_id)  # greedy: the same tokens, until the first stop id (which is kept)
    stopped = client.complete("The quick", max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    assert stopped.completions[0].finish_reason == "stop"
    assert list(stopped.completions[0].token_ids) == free[: at + 1]


def test_tokenize_detokenize_and_info(llama_dir, client):
    tok = Tokenizer.from_dir(llama_dir)
    text = "Émigré naïve café 🦊"
    assert client.tokenize(text) == tok.encode(text)
    assert client.detokenize(tok.encode(text)) == text
    info = client.model_info()
    assert (info.name, info.architecture, info.max_context, info.dtype) == ("tiny", "llama", 256, "float32")
    assert (info.quantization, info.speculative_mode, info.kv_blocks, info.kv_block_size) == ("none", "none", 64, 8)
    s = client.server_info()
    assert s.state == "serving" and s.kv_blocks_total == 64 and s.uptime_s > 0
    assert (s.spec_proposed_tokens, s.spec_accepted_tokens, s.spec_acceptance_rate) == (0, 0, 0.0)  # no speculation


def test_cancel_and_deadline_abort_and_free_kv(client):
    stream = client.generate("The quick brown fox", max_tokens=200, temperature=0, ignore_eos=True)
    next(stream)
    assert client.server_info().kv_blocks_free < 64  # the stream holds blocks
    stream.close()  # the client cancels the call
    info = wait_idle(client)
    assert (info.engine_requests, info.kv_blocks_free) == (0, 64)
    t0 = time.monotonic()  # the deadline is a quarter of what the same call takes here, whatever this machine's speed
    list(client.generate("The quick brown fox", max_tokens=230, temperature=0, ignore_eos=True))
    timeout = (time.monotonic() - t0) / 4
    with pytest.raises(grpc.RpcError) as e:
        for _ in client.generate(
            "The quick brown fox", max_tokens=230, temperature=0, ignore_eos=True, timeout=timeout
        ):
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = wait_idle(client)
    assert (info.engine_requests, info.kv_blocks_free) == (0, 64)


def test_overload_is_resource_exhausted(client):
    """3 running + 2 queued fit; the 6th call is refused, the queued ones still complete."""
    streams = [client.generate(p, max_tokens=200, temperature=0, ignore_eos=True) for p in PROMPTS[:5]]
    firsts = [None] * 5
    threads = [threading.Thread(target=lambda i=i: firsts.__setitem__(i, next(streams[i]))) for i in range(5)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while client.server_info().queued_calls < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("one more", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "server is full" in e.value.details()
    for t, s in zip(threads, streams):
        t.join(30)
        assert sum(len(m.completions[0].token_ids) for m in s) + 1 == 200
    assert all(f is not None for f in firsts)
    assert wait_idle(client).kv_blocks_free == 64


def test_metrics_add_up(server, client):
    list(client.generate("The lazy dog", max_tokens=5, temperature=0))
    with pytest.raises(grpc.RpcError):
        client.complete("", max_tokens=5)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    api = "baton.serve.v1.BatonService/Generate"
    req = {
        (s.labels["api"], s.labels["outcome"]): s.value
        for s in fams["baton_requests"].samples
        if s.name == "baton_requests_total"
    }
    assert req[(api, "ok")] >= 2 and req[(api, "invalid_argument")] >= 1
    ttft = next(s.value for s in fams["baton_time_to_first_token_seconds"].samples if s.name.endswith("_count"))
    assert ttft >= req[(api, "ok")]
    kv = {s.labels["state"]: s.value for s in fams["baton_kv_blocks"].samples}
    assert kv["used"] + kv["free"] == 64
    for name in (
        "baton_inter_token_latency_seconds",
        "baton_queued_calls",
        "baton_running_batch_size",
        "baton_prefix_cache_hit_rate",
        "baton_preemptions",
        "baton_generation_tokens_per_second",
    ):
        assert name in fams, name
    assert next(s.value for s in fams["baton_generation_tokens"].samples) > 0


def test_draining_refuses_new_calls(llama_dir):
    s = ServerThread(llama_dir, num_kv_blocks=32, drain_timeout_s=20)
    with BatonClient(s.target, timeout=30) as c:
        stream = c.generate("The quick brown fox", max_tokens=240, temperature=0, ignore_eos=True)
        got = list(next(stream).completions[0].token_ids)
        stopping = threading.Thread(target=s.stop)
        stopping.start()
        deadline = time.monotonic() + 5
        while c.health() == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.health() == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as e:
            c.complete("new work", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
        got += [t for m in stream for t in m.completions[0].token_ids]  # the in-flight stream finishes
        stopping.join(30)
    assert len(got) == 240


def test_engine_failure_fails_health(llama_dir):
    """If the engine loop dies, the request fails with INTERNAL, health turns NOT_SERVING (so an
    orchestrator restarts us) and new calls are refused."""
    s = ServerThread(llama_dir, num_kv_blocks=32)

    def broken_step():
        raise RuntimeError("simulated device fault")

    s.server.rt.async_engine.engine.step = broken_step
    try:
        with BatonClient(s.target, timeout=30) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.complete("The fox", max_tokens=4)
            assert e.value.code() == grpc.StatusCode.INTERNAL and "simulated device fault" in e.value.details()
            assert c.health() == "NOT_SERVING" and c.server_info().state == "failed"
            with pytest.raises(grpc.RpcError) as e:
                c.complete("The fox", max_tokens=4)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "restarted" in e.value.details()
    finally:
        s.stop()


def test_speculative_server_streams_the_plain_greedy_output(llama_dir):
    """With n-gram speculation on, ModelInfo says so and the streamed greedy tokens still equal the
    plain offline engine's (speculative steps deliver several tokens per message)."""
    from baton.serve.speculative import SpeculativeConfig

    prompts = ["The fox. The fox. The fox. The", "def f(x):\n    return x * 2\ndef f(x):"]
    ref = offline(llama_dir, prompts, max_tokens=30, ignore_eos=True)
    s = ServerThread(llama_dir, speculative=SpeculativeConfig("ngram", num_speculative_tokens=3))
    try:
        with BatonClient(s.target, timeout=60) as c:
            assert c.model_info().speculative_mode == "ngram k=3" and c.server_info().spec_speedup == 0
            for prompt, (ids, text, _) in zip(prompts, ref):
                msgs = list(c.generate(prompt, max_tokens=30, temperature=0, ignore_eos=True))
                assert [t for m in msgs for t in m.completions[0].token_ids] == ids
                assert "".join(m.completions[0].text for m in msgs) == text
            info = c.server_info()
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{s.server.metrics_port}/metrics", timeout=10).read().decode()
            )
    finally:
        s.stop()
    # The same requests, one at a time, through an offline engine with the same proposer: the
    # server reports exactly its proposal and acceptance counts.
    engine = LLMEngine.from_checkpoint(
        llama_dir,
        EngineConfig(num_kv_blocks=64, block_size=8, speculative=SpeculativeConfig("ngram", num_speculative_tokens=3)),
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    want = engine.speculative.stats
    assert want.proposed > 0 and 0 < want.accepted <= want.proposed
    assert (info.spec_proposed_tokens, info.spec_accepted_tokens) == (want.proposed, want.accepted)
    assert info.spec_acceptance_rate == pytest.approx(want.acceptance_rate)
    assert info.spec_mean_accepted_length == pytest.approx(want.mean_accepted_length)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert next(x.value for x in fams["baton_spec_proposed_tokens"].samples) == want.proposed
    assert next(x.value for x in fams["baton_spec_accepted_tokens"].samples) == want.accepted
    assert next(x.value for x in fams["baton_spec_acceptance_rate"].samples) == pytest.approx(want.acceptance_rate)
    assert want.accepted_by_depth[0] > 0  # per depth, in ServerInfo and on /metrics
    assert (list(info.spec_proposed_by_depth), list(info.spec_accepted_by_depth)) == (
        want.proposed_by_depth,
        want.accepted_by_depth,
    )
    accepted = {x.labels["depth"]: x.value for x in fams["baton_spec_accepted_by_depth"].samples}
    assert accepted == {str(d): n for d, n in enumerate(want.accepted_by_depth, start=1)}
    assert info.spec_method == "ngram" and {
        x.labels["method"] for f in fams.values() if f.name.startswith("baton_spec_") for x in f.samples
    } == {"ngram"}
    # The speed-up: decode steps timed by batch size; one request at a time, so all at batch 1. Every
    # token after each request's first (sampled by its prefill step) came from a timed decode step,
    # and the run had steps with no n-gram proposal as well (the baseline), so it was measured.
    assert set(want.spec_steps) == set(want.plain_steps) == {1}
    assert want.spec_steps[1][1] + want.plain_steps[1][1] == 2 * (30 - 1)
    assert info.spec_speedup > 0
    assert next(x.value for x in fams["baton_spec_speedup"].samples) == pytest.approx(info.spec_speedup)


def test_quantized_checkpoint_reports_its_quantization(llama_dir, tmp_path):
    from baton.serve.quantization.config import QuantConfig
    from baton.serve.quantization.quantize import quantize_checkpoint

    qdir = quantize_checkpoint(llama_dir, tmp_path / "int8", QuantConfig(method="rtn", bits=8))
    s = ServerThread(qdir)
    try:
        with BatonClient(s.target, timeout=60) as c:
            assert c.model_info().quantization == "rtn int8"
            assert c.complete("The fox", max_tokens=4, temperature=0).finished
    finally:
        s.stop()
