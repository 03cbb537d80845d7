"""SIGTERM while streams are in flight (some running, some queued): health turns NOT_SERVING,
new calls get UNAVAILABLE, every in-flight stream completes with the offline engine's output,
and `baton serve` exits 0. The server runs with TLS and a token file, so those flags are
exercised end to end too."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from baton.serve.client import BatonClient

from .server_fixtures import PROMPTS, ServerProcess, make_tls, offline

pytestmark = pytest.mark.slow
TOKEN = "drain-token"
MAX_TOKENS = 240  # ~0.15 s a stream: far longer than the signal takes to arrive


def test_sigterm_drains_in_flight_streams(llama_dir, tmp_path):
    tls = make_tls(tmp_path)
    (tmp_path / "token").write_text(TOKEN)
    prompts = PROMPTS[:6]
    reference = offline(llama_dir, prompts, MAX_TOKENS, ignore_eos=True)
    server = ServerProcess(
        tmp_path,
        "--model",
        str(llama_dir),
        "--model-name",
        "tiny",
        "--num-kv-blocks",
        "128",
        "--block-size",
        "8",
        "--max-concurrent",
        "2",
        "--max-queued",
        "8",
        "--drain-timeout",
        "60",
        "--tls-cert",
        str(tls["cert"]),
        "--tls-key",
        str(tls["key"]),
        "--auth-token-file",
        str(tmp_path / "token"),
    )
    try:
        client = BatonClient(server.target, token=TOKEN, ca_file=str(tls["ca"]), timeout=120)
        got: list[list[int] | Exception] = [[] for _ in prompts]

        def stream(i: int):
            try:
                for msg in client.generate(prompts[i], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True):
                    got[i] += msg.completions[0].token_ids
            except grpc.RpcError as e:
                got[i] = e

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while (info := client.server_info()).active_calls + info.queued_calls < len(prompts):
            assert time.monotonic() < deadline, info
            time.sleep(0.01)
        assert info.queued_calls > 0  # some are still waiting for a slot when the signal comes
        server.proc.terminate()
        deadline = time.monotonic() + 10
        while client.health() == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.health() == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as e:
            client.complete("new work", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        for t in threads:
            t.join(120)
        client.close()
        for i, (ids, _, _) in enumerate(reference):
            assert got[i] == ids, f"stream {i}: {got[i]!r}"[:300]
    finally:
        rc = server.terminate()
    assert rc == 0, server.log()
    log = server.log()
    assert "draining: 6 requests in flight" in log and "stopped" in log
