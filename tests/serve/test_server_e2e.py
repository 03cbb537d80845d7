"""End to end against a real `baton serve` subprocess on loopback: streamed greedy output equals the
offline engine's, through our client and the stock tritonclient (streaming and ModelInfer);
health and reflection answer; 120 concurrent streams, a third cancelling midway, leave every
completed stream correct, none lost, the KV pool whole and the server healthy."""

from __future__ import annotations

import asyncio
import json
import queue
import random
import time
import urllib.request
from contextlib import aclosing

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from baton.serve.client import AsyncBatonClient, BatonClient

from .server_fixtures import PROMPTS, ServerProcess, offline

pytestmark = pytest.mark.slow
tc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a dev dependency")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    s = ServerProcess(
        tmp_path_factory.mktemp("e2e"),
        "--model",
        str(llama_dir),
        "--model-name",
        "tiny",
        "--num-kv-blocks",
        "160",
        "--block-size",
        "8",
        "--max-num-seqs",
        "48",
        "--max-concurrent",
        "48",
        "--max-queued",
        "200",
    )
    yield s
    assert s.terminate() == 0, s.log()


@pytest.fixture(scope="module")
def reference(llama_dir):
    return dict(zip(PROMPTS, offline(llama_dir, PROMPTS, MAX_TOKENS)))


def triton_inputs(prompt: str, stream: bool, exclude_input: bool | None = None):
    ins = [
        tc.InferInput("text_input", [1], "BYTES"),
        tc.InferInput("stream", [1], "BOOL"),
        tc.InferInput("sampling_parameters", [1], "BYTES"),
    ]
    ins[0].set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    ins[1].set_data_from_numpy(np.array([stream]))
    ins[2].set_data_from_numpy(
        np.array([json.dumps({"temperature": "0", "max_tokens": str(MAX_TOKENS)}).encode()], dtype=object)
    )
    if exclude_input is not None:
        ins.append(tc.InferInput("exclude_input_in_output", [1], "BOOL"))
        ins[-1].set_data_from_numpy(np.array([exclude_input]))
    return ins


def test_baton_stream_matches_offline(server, reference):
    with BatonClient(server.target, timeout=60) as c:
        for prompt in PROMPTS[:4]:
            msgs = list(c.generate(prompt, max_tokens=MAX_TOKENS, temperature=0))
            ids, text, reason = reference[prompt]
            assert [t for m in msgs for t in m.completions[0].token_ids] == ids
            assert "".join(m.completions[0].text for m in msgs) == text
            assert msgs[-1].finished and msgs[-1].completions[0].finish_reason == reason


def test_tritonclient_stream_and_infer_match_offline(server, reference):
    client = tc.InferenceServerClient(server.target)
    results: queue.Queue = queue.Queue()
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
        assert client.get_model_metadata("tiny").outputs[0].name == "text_output"
        for prompt in PROMPTS[:3]:
            out = client.infer("tiny", triton_inputs(prompt, stream=False))  # default: the prompt is repeated
            assert out.as_numpy("text_output")[0].decode() == prompt + reference[prompt][1]
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for empty_final in (True, False):
            for prompt in PROMPTS[3:6]:
                client.async_stream_infer(
                    "tiny",
                    triton_inputs(prompt, stream=True, exclude_input=True),
                    request_id=prompt,
                    enable_empty_final_response=empty_final,
                )
                pieces, final = [], False
                while not final:
                    result, error = results.get(timeout=60)
                    assert error is None, error
                    final = result.get_response().parameters["triton_final_response"].bool_param
                    data = result.as_numpy("text_output")
                    assert (data is None) == (final and empty_final)  # the empty final response has no data
                    pieces += [] if data is None else [data[0].decode()]
                assert "".join(pieces) == reference[prompt][1], (prompt, empty_final)
    finally:
        client.stop_stream()
        client.close()


def test_health_and_reflection(server):
    with BatonClient(server.target, timeout=30) as c:
        for service in ("", "baton.serve.v1.BatonService", "inference.GRPCInferenceService"):
            assert c.health(service) == "SERVING"
    with grpc.insecure_channel(server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert set(db.get_services()) == {
            "baton.serve.v1.BatonService",
            "inference.GRPCInferenceService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        pool = DescriptorPool(db)
        fields = {f.name: f.number for f in pool.FindMessageTypeByName("inference.ModelInferRequest").fields}
        assert fields["raw_input_contents"] == 7
        assert pool.FindFileContainingSymbol("baton.serve.v1.GenerateRequest").name == "baton/serve/v1/baton.proto"
        assert pool.FindServiceByName("grpc.health.v1.Health").methods_by_name["Check"]


def scrape(server: ServerProcess) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "baton_requests")
    return {(s.labels["api"], s.labels["outcome"]): s.value for s in fam.samples if s.name == "baton_requests_total"}


def test_load_with_cancellations(server, reference):
    n, rng = 120, random.Random(5)
    cancel_after = {i: rng.randint(1, 3) for i in rng.sample(range(n), n // 3)}  # tokens to read, then leave
    # A stream the client leaves asks for far more tokens than it reads, so the server is still decoding
    # it when the cancellation arrives even if the client's event loop lags behind a fast engine.
    before = scrape(server)

    async def one(client: AsyncBatonClient, i: int):
        prompt, ids, finished = PROMPTS[i % len(PROMPTS)], [], False
        max_tokens = 200 if i in cancel_after else MAX_TOKENS
        async with aclosing(client.generate(prompt, max_tokens=max_tokens, temperature=0)) as stream:
            async for msg in stream:
                ids += msg.completions[0].token_ids
                finished = msg.finished
                if i in cancel_after and len(ids) >= cancel_after[i] and not finished:
                    break
        return prompt, ids, finished

    async def main():
        clients = [AsyncBatonClient(server.target, timeout=120) for _ in range(4)]
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(clients[i % 4], i) for i in range(n))), 150)
        finally:
            for c in clients:
                await c.close()

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    done = [r for r in results if r[2]]
    left = [r for r in results if not r[2]]
    assert len(done) + len(left) == n and len(left) >= n // 4, (len(done), len(left))
    for prompt, ids, _ in done:
        assert ids == reference[prompt][0], prompt
    for prompt, ids, _ in left:
        assert ids and ids[:MAX_TOKENS] == reference[prompt][0][: len(ids)], prompt  # greedy: same prefix
    with BatonClient(server.target, timeout=30) as c:
        deadline = time.monotonic() + 10
        while (info := c.server_info()).engine_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (info.engine_requests, info.active_calls, info.queued_calls) == (0, 0, 0)
        assert info.kv_blocks_free == info.kv_blocks_total == 160
        assert c.health() == "SERVING"
        assert (
            list(c.complete(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0).completions[0].token_ids)
            == reference[PROMPTS[0]][0]
        )
    # Every call is counted once. A stream the client left may still count as "ok": the server can
    # have sent its last message before the cancellation reached it.
    api = "baton.serve.v1.BatonService/Generate"
    deadline = time.monotonic() + 10  # a request is counted just after its last message is sent
    while True:
        after = scrape(server)
        got = {k: after.get((api, k), 0) - before.get((api, k), 0) for k in ("cancelled", "ok")}
        if got["cancelled"] + got["ok"] == n + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got["cancelled"] + got["ok"] == n + 1, got
    assert 1 <= got["cancelled"] <= len(left) and got["ok"] >= len(done) + 1, (got, len(done), len(left))
    print(f"load: {n} streams in {elapsed:.1f} s, {len(left)} left midway, {got['cancelled']:.0f} counted cancelled")
