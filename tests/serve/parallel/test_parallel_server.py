"""`baton serve --tensor-parallel-size 2` end to end over gRPC: Baton's client and the stock
tritonclient (KServe v2: ModelInfer and a decoupled stream) get greedy output equal to the
single-process offline engine's, also with concurrent streams batched together across the ranks;
/metrics and ServerInfo answer; SIGTERM drains the in-flight streams to completion, stops the
workers and exits 0."""

from __future__ import annotations

import json
import queue
import re
import signal
import threading
import time
import urllib.request

import grpc
import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.serve.client import BatonClient

from ..server_fixtures import PROMPTS, ServerProcess, offline

pytestmark = pytest.mark.slow
tc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a dev dependency")
MAX_TOKENS = 24
DRAIN_TOKENS = 120  # a stream long enough to be in flight when SIGTERM arrives


@pytest.fixture(scope="module")
def reference(llama_dir):
    return dict(zip(PROMPTS, offline(llama_dir, PROMPTS, MAX_TOKENS)))


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    s = ServerProcess(
        tmp_path_factory.mktemp("tp2"),
        *("--model", str(llama_dir), "--model-name", "tiny", "--tensor-parallel-size", "2"),
        *("--num-kv-blocks", "96", "--block-size", "8", "--max-num-seqs", "16", "--drain-timeout", "60"),
    )
    yield s
    s.terminate()  # the drain test stops it; this only cleans up after a failure


def triton_inputs(prompt: str, stream: bool) -> list:
    ins = [
        tc.InferInput("text_input", [1], "BYTES"),
        tc.InferInput("stream", [1], "BOOL"),
        tc.InferInput("sampling_parameters", [1], "BYTES"),
        tc.InferInput("exclude_input_in_output", [1], "BOOL"),
    ]
    ins[0].set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    ins[1].set_data_from_numpy(np.array([stream]))
    ins[2].set_data_from_numpy(
        np.array([json.dumps({"temperature": "0", "max_tokens": str(MAX_TOKENS)}).encode()], dtype=object)
    )
    ins[3].set_data_from_numpy(np.array([True]))
    return ins


def test_baton_and_triton_clients_get_the_single_process_greedy_output(server, reference):
    assert "2 ranks ready" in server.log() and "(tensor 2 x pipeline 1)" in server.log()
    with BatonClient(server.target, timeout=60) as c:
        for prompt in PROMPTS[:3]:
            msgs = list(c.generate(prompt, max_tokens=MAX_TOKENS, temperature=0))
            ids, text, reason = reference[prompt]
            assert [t for m in msgs for t in m.completions[0].token_ids] == ids, prompt
            assert "".join(m.completions[0].text for m in msgs) == text
            assert msgs[-1].finished and msgs[-1].completions[0].finish_reason == reason

        # Twelve streams at once: the ranks run them in shared batches (continuous batching).
        got: dict[str, list[int]] = {}

        def one(prompt: str) -> None:
            got[prompt] = [
                t for m in c.generate(prompt, max_tokens=MAX_TOKENS, temperature=0) for t in m.completions[0].token_ids
            ]

        threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == {p: reference[p][0] for p in PROMPTS}
        info = c.server_info()
        assert info.kv_blocks_total == 96 and info.kv_blocks_free == 96 and info.engine_requests == 0

    client = tc.InferenceServerClient(server.target)
    results: queue.Queue = queue.Queue()
    try:
        assert client.is_server_ready() and client.is_model_ready("tiny")
        for prompt in PROMPTS[3:5]:
            out = client.infer("tiny", triton_inputs(prompt, stream=False))
            assert out.as_numpy("text_output")[0].decode() == reference[prompt][1], prompt
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for prompt in PROMPTS[5:7]:
            client.async_stream_infer("tiny", triton_inputs(prompt, stream=True), request_id=prompt)
            pieces, final = [], False
            while not final:
                result, error = results.get(timeout=60)
                assert error is None, error
                final = result.get_response().parameters["triton_final_response"].bool_param
                data = result.as_numpy("text_output")
                pieces += [] if data is None else [data[0].decode()]
            assert "".join(pieces) == reference[prompt][1], prompt
    finally:
        client.stop_stream()
        client.close()


def test_metrics_count_the_calls(server):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    calls = {
        (s.labels["api"], s.labels["outcome"]): s.value
        for s in fams["baton_requests"].samples
        if s.name == "baton_requests_total"
    }
    assert calls[("baton.serve.v1.BatonService/Generate", "ok")] >= 3 + len(PROMPTS)
    assert sum(v for (api, outcome), v in calls.items() if "inference" in api and outcome == "ok") >= 4
    kv = {s.labels["state"]: s.value for s in fams["baton_kv_blocks"].samples}
    assert sum(kv.values()) == 96, kv


def test_sigterm_drains_in_flight_streams_then_stops_the_workers(server, llama_dir):
    prompts = PROMPTS[:4]
    want = [ids for ids, _, _ in offline(llama_dir, prompts, DRAIN_TOKENS, ignore_eos=True)]
    pids = [int(p) for p in re.search(r"spawned worker pids \[([\d, ]+)\]", server.log())[1].split(",")]
    workers = [psutil.Process(p) for p in pids]
    got: list = [[] for _ in prompts]
    c = BatonClient(server.target, timeout=120)

    def stream(i: int) -> None:
        try:
            for m in c.generate(prompts[i], max_tokens=DRAIN_TOKENS, temperature=0, ignore_eos=True):
                got[i] += m.completions[0].token_ids
        except grpc.RpcError as e:
            got[i] = e

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(isinstance(g, list) and g for g in got):
        assert time.monotonic() < deadline and not any(isinstance(g, Exception) for g in got), got
        time.sleep(0.01)
    assert all(len(g) < DRAIN_TOKENS for g in got), "a stream finished before the signal: nothing to drain"
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(90)
    stopped = time.monotonic() - t0
    for t in threads:
        t.join(10)
    assert code == 0, server.log()[-3000:]
    assert got == want  # every in-flight stream ran to completion on the sharded model, correctly
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    assert "rank 1 stopping" in server.log()  # the worker was told to stop, not killed
    print(f"T=2 drain: 4 streams finished and the server exited {stopped:.1f} s after SIGTERM")
