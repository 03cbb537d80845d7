"""Helpers for the server tests: in-process servers, `baton serve` subprocesses, TLS material,
and the independent reference (the offline engine's greedy output)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from baton.serve.async_engine import AsyncLLMEngine
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.llm import LLM
from baton.serve.sampling_params import SamplingParams
from baton.serve.server import BatonServer, ServerConfig

PROMPTS = [
    "The quick brown fox",
    "def f(x):",
    "Émigré naïve café",
    "The lazy dog jumps over",
    "return x * 2",
    "quick brown",
    "日本語のテキスト",
    "The fox. The dog. The",
    "café 🦊",
    "over the lazy",
    "x * 2\n",
    "jumps",
]
BATON = [sys.executable, "-m", "baton.common.cli"]


def offline(
    model_dir: Path, prompts: list[str], max_tokens: int, ignore_eos: bool = False
) -> list[tuple[list[int], str, str]]:
    """(token ids, text, finish reason) per prompt from the offline LLM, greedy."""
    llm = LLM(model_dir, EngineConfig(num_kv_blocks=256, block_size=8))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


class ServerThread:
    """A BatonServer on its own event loop thread, so tests can use blocking clients."""

    def __init__(self, model_dir: Path, num_kv_blocks: int = 64, speculative=None, engine_extra=None, **config):
        """`engine_extra`: more EngineConfig fields (e.g. early_exit_threshold); `config`: ServerConfig's."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        engine_config = EngineConfig(
            num_kv_blocks=num_kv_blocks, block_size=8, speculative=speculative, **(engine_extra or {})
        )
        engine = AsyncLLMEngine(LLMEngine.from_checkpoint(model_dir, engine_config))
        config = {"port": 0, "metrics_port": 0, "model_name": "tiny", **config}
        self.server = BatonServer(ServerConfig(model=str(model_dir), **config), engine)
        self.run(self.server.start())
        self.run(self.server.load())
        self.target = f"127.0.0.1:{self.server.port}"

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.server.drain_and_stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class ServerProcess:
    """`baton serve` in a subprocess on free loopback ports; ports are read from its log."""

    def __init__(self, tmp: Path, *args: str, timeout: float = 60):
        self.log_path = tmp / f"serve-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*BATON, "serve", "--port", "0", "--metrics-port", "0", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + timeout
        while not (m := re.search(r"ready: .* grpc=([\d.]+):(\d+) .* metrics=http://[\d.]+:(\d+)/", self.log())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"baton serve did not become ready:\n{self.log()}")
            time.sleep(0.05)
        self.target = f"{m[1]}:{m[2]}"
        self.metrics_url = f"http://{m[1]}:{m[3]}/metrics"

    def log(self) -> str:
        return self.log_path.read_text()

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()


def make_tls(tmp: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost that it signed (openssl CLI)."""
    p = {k: tmp / f"{k}.pem" for k in ("ca", "ca_key", "cert", "key", "other_ca", "other_ca_key")}
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca, key in (("ca", "ca_key"), ("other_ca", "other_ca_key")):
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                *ec,
                "-keyout",
                p[key],
                "-out",
                p[ca],
                "-days",
                "1",
                "-subj",
                f"/CN=baton-test-{ca}",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign",
            ],
            check=True,
            capture_output=True,
        )
    csr = tmp / "server.csr"
    subprocess.run(
        ["openssl", "req", *ec, "-keyout", p["key"], "-out", csr, "-subj", "/CN=localhost"],
        check=True,
        capture_output=True,
    )
    ext = tmp / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    subprocess.run(
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            p["ca"],
            "-CAkey",
            p["ca_key"],
            "-CAcreateserial",
            "-out",
            p["cert"],
            "-days",
            "1",
            "-extfile",
            ext,
        ],
        check=True,
        capture_output=True,
    )
    return p
