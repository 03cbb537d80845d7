"""/metrics has no authentication, so it binds loopback unless widened on purpose: `baton serve
--host 0.0.0.0` opens the gRPC port (which can require a token) to the network, not the metrics.
The bound addresses are read from the kernel (psutil), not from what the server logs."""

from __future__ import annotations

import os
import urllib.request

import psutil
import pytest

from .server_fixtures import ServerProcess, ServerThread


def _listening(pid: int, port: int) -> set[str]:
    """The addresses a process listens on at `port`, as the kernel reports them (IPv4-mapped ones as IPv4:
    gRPC binds 127.0.0.1 on a dual-stack socket)."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return {
        c.laddr.ip.removeprefix("::ffff:") for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


@pytest.mark.slow
def test_metrics_stay_on_loopback_when_grpc_binds_all_interfaces(llama_dir, tmp_path):
    server = ServerProcess(tmp_path, "--model", str(llama_dir), "--host", "0.0.0.0")
    try:
        grpc_port, metrics_port = int(server.target.rsplit(":", 1)[1]), int(server.metrics_url.split(":")[-1][:-8])
        assert _listening(server.proc.pid, grpc_port) & {"0.0.0.0", "::"}, "gRPC was asked to bind every interface"
        assert _listening(server.proc.pid, metrics_port) == {"127.0.0.1"}
        assert f"metrics=http://127.0.0.1:{metrics_port}/metrics" in server.log()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            assert b"baton_kv_blocks" in r.read()
    finally:
        assert server.terminate() == 0


def test_metrics_host_is_honoured(llama_dir):
    """Widening is explicit: here another loopback address, so nothing is exposed by the test."""
    server = ServerThread(llama_dir, metrics_host="127.0.0.2")
    try:
        assert _listening(os.getpid(), server.server.metrics_port) == {"127.0.0.2"}
        assert _listening(os.getpid(), server.server.port) == {"127.0.0.1"}
    finally:
        server.stop()


def test_cli_passes_metrics_host(monkeypatch, tmp_path):
    import baton.serve.server as server_module
    from baton.common.cli import main

    seen = []
    monkeypatch.setattr(server_module, "run", lambda config: seen.append(config) or 0)
    assert main(["serve", "--model", str(tmp_path), "--host", "0.0.0.0"]) == 0
    assert main(["serve", "--model", str(tmp_path), "--metrics-host", "::1"]) == 0
    assert [(c.host, c.metrics_host) for c in seen] == [("0.0.0.0", "127.0.0.1"), ("127.0.0.1", "::1")]
