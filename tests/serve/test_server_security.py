"""TLS and bearer-token auth: a client with the CA and the token gets through (our client, the
stock tritonclient, `baton query`); without the token, with a wrong one, in plaintext or with
another CA, it does not. Health checks need no token (probes carry none)."""

from __future__ import annotations

import re
import subprocess

import grpc
import numpy as np
import pytest

from baton.serve.client import BatonClient

from .server_fixtures import BATON, ServerThread, make_tls

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(llama_dir, tls):
    s = ServerThread(llama_dir, tls_cert=str(tls["cert"]), tls_key=str(tls["key"]), auth_token=TOKEN)
    yield s
    s.stop()


def test_token_and_ca_required(server, tls):
    with BatonClient(server.target, token=TOKEN, ca_file=str(tls["ca"]), timeout=30) as c:
        assert c.complete("The fox", max_tokens=3, temperature=0).finished
    for token in (None, "wrong", TOKEN + "x"):
        with BatonClient(server.target, token=token, ca_file=str(tls["ca"]), timeout=30) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.complete("The fox", max_tokens=3)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, token
            assert c.health() == "SERVING"
    for ca in (None, tls["other_ca"]):  # plaintext, or TLS trusting someone else
        with BatonClient(server.target, token=TOKEN, ca_file=ca and str(ca), timeout=5) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.complete("The fox", max_tokens=3)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tritonclient_over_tls_with_token(server, tls):
    tc = pytest.importorskip("tritonclient.grpc")
    client = tc.InferenceServerClient(server.target, ssl=True, root_certificates=str(tls["ca"]))
    try:
        text = tc.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"The fox"], dtype=object))
        with pytest.raises(tc.InferenceServerException) as e:
            client.infer("tiny", [text])
        assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        result = client.infer("tiny", [text], headers={"authorization": f"Bearer {TOKEN}"})
        assert result.as_numpy("text_output")[0].startswith(b"The fox")
    finally:
        client.close()


def test_baton_query_cli(server, tls, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    common = [*BATON, "query", "--target", server.target, "--ca", str(tls["ca"])]
    ok = subprocess.run(
        [*common, "--auth-token-file", str(token_file), "The fox", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert re.search(r"\d+ prompt \+ [1-4] generated tokens", ok.stderr), ok.stderr
    denied = subprocess.run(
        [*common, "The fox"], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
    )
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
