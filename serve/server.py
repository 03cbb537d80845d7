"""`baton serve`: the gRPC server — Baton's API, KServe v2, health, reflection, Prometheus metrics.

Life cycle: bind and answer health NOT_SERVING -> load the model -> SERVING -> on SIGTERM/SIGINT
drain: health NOT_SERVING, new calls UNAVAILABLE, in-flight streams run to completion for up
to the drain timeout (then they are cancelled, which frees their KV blocks) -> exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.common.config import DTYPES
from baton.serve import proto
from baton.serve.async_engine import AsyncLLMEngine
from baton.serve.baton_service import BatonService
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.gate import Gate
from baton.serve.kserve import KServeService
from baton.serve.openai.tool_calling import AgentConfig
from baton.serve.quantization.loader import quantization_config
from baton.serve.runtime import Limits, Runtime

log = logging.getLogger(__name__)
SERVICES = (proto.BATON_SERVICE, proto.KSERVE_SERVICE)


@dataclass
class ServerConfig:
    model: str  # checkpoint directory
    model_name: str | None = None  # default: the directory's name
    host: str = "127.0.0.1"  # loopback unless widened on purpose
    port: int = 8001  # 0: any free port (logged)
    metrics_port: int | None = 8002  # None: no metrics endpoint
    http_port: int | None = None  # the OpenAI-compatible HTTP API (serve/openai/); None: off, 0: any free port
    metrics_host: str = "127.0.0.1"  # /metrics has no auth: loopback (a local Prometheus agent) unless widened
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = None
    auth_token: str | None = None  # clients send metadata `authorization: Bearer <token>`
    drain_timeout_s: float = 30.0
    device: str = "cpu"
    dtype: str | None = None  # float32 | float16 | bfloat16; default: the checkpoint's
    limits: Limits = field(default_factory=Limits)
    engine: EngineConfig = field(default_factory=EngineConfig)
    agents: AgentConfig = field(default_factory=AgentConfig)  # tool calling and reasoning (the HTTP API's)

    def validate(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and a key file")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.drain_timeout_s < 0:
            raise ValueError("the drain timeout must be >= 0 seconds")
        self.limits.validate()
        self.agents.validate()


class BatonServer:
    """One server; `engine` may be passed in (tests, benchmarks) instead of loaded from config.model,
    and `runtime` too (serve/coe/: several engines behind one server)."""

    def __init__(self, config: ServerConfig, engine: AsyncLLMEngine | None = None, runtime: Runtime | None = None):
        config.validate()
        self.config = config
        self.rt = runtime or Runtime(config.model_name or Path(config.model).resolve().name, config.limits)
        self._engine = engine
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._http = None  # serve/openai/http_server.HttpFront when http_port is set

    async def start(self) -> None:
        """Bind and answer (NOT_SERVING) before the model is loaded, so probes see us loading."""
        cfg, size = self.config, self.config.limits.max_message_bytes
        server = grpc.aio.server(
            interceptors=[Gate(self.rt, cfg.auth_token)],
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
                ("grpc.so_reuseport", 0),
            ],
        )  # a second server must not share our port
        server.add_generic_rpc_handlers((BatonService(self.rt).handler(), KServeService(self.rt).handler()))
        health_pb2_grpc.add_HealthServicer_to_server(self.rt.health, server)
        reflection.enable_server_reflection(
            (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server, pool=proto.pool()
        )
        await self.rt.set_state("loading")
        address = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"  # IPv6 literals
        try:
            if cfg.tls_cert:
                pem = [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())]
                self.port = server.add_secure_port(address, grpc.ssl_server_credentials(pem))
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpc's way of saying "could not bind"
            self.port = 0
        if not self.port:
            raise ValueError(f"cannot listen on {address}: the port is in use or the host is not this machine's")
        await server.start()
        self._server = server
        if cfg.metrics_port is not None:
            try:
                self.metrics_port = self.rt.metrics.serve(cfg.metrics_host, cfg.metrics_port)
            except OSError as e:
                await server.stop(None)
                raise ValueError(f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {e}") from None
        if cfg.http_port is not None:
            from baton.serve.openai.http_server import HttpFront  # the web stack only when asked for

            tls = (cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None
            try:
                self._http = HttpFront(self.rt, cfg.model, cfg.host, cfg.http_port, cfg.auth_token, tls, cfg.agents)
                await self._http.start()
            except ValueError:
                await server.stop(None)
                self.rt.metrics.close()
                raise
            self.http_port = self._http.port
        log.info(
            "listening on %s:%d (%s), not serving until the model is loaded",
            cfg.host,
            self.port,
            "TLS" if cfg.tls_cert else "plaintext",
        )

    async def load(self) -> None:
        cfg = self.config
        if self._engine is None:
            t0 = time.monotonic()
            dtype = DTYPES[cfg.dtype] if cfg.dtype else None
            core = await asyncio.to_thread(LLMEngine.from_checkpoint, cfg.model, cfg.engine, cfg.device, dtype)
            self._engine = AsyncLLMEngine(core)
            log.info("loaded %s in %.1f s", cfg.model, time.monotonic() - t0)
        q = quantization_config(cfg.model)
        self.rt.quantization = "none" if q is None else f"{q.get('method')} {q.get('format')}"
        if self._http is not None:
            # the chat template and the tool/reasoning parsers, before the first request
            await asyncio.to_thread(self._http.prepare, self._engine.engine)
        self.rt.metrics.watch_grammars(self._engine.engine.grammars.stats)
        await self.rt.attach(self._engine)
        self._log_ready()

    def _log_ready(self) -> None:
        cfg = self.config
        mhost = f"[{cfg.metrics_host}]" if ":" in cfg.metrics_host else cfg.metrics_host
        metrics = f"http://{mhost}:{self.metrics_port}/metrics" if self.metrics_port is not None else "off"
        http = f"{cfg.host}:{self.http_port}" if self.http_port is not None else "off"
        log.info(
            "ready: model=%s grpc=%s:%d tls=%s auth=%s metrics=%s http=%s",
            self.rt.model_name,
            cfg.host,
            self.port,
            "on" if cfg.tls_cert else "off",
            "on" if cfg.auth_token else "off",
            metrics,
            http,
        )

    async def drain_and_stop(self) -> None:
        """Refuse new work, let in-flight requests finish (up to the drain timeout), then stop."""
        await self.rt.set_state("draining")
        adm = self.rt.admission
        deadline = time.monotonic() + self.config.drain_timeout_s
        if adm.active:
            log.info("draining: %d requests in flight, waiting up to %.0f s", adm.active, self.config.drain_timeout_s)
        while adm.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if adm.active:
            log.warning("drain timeout: cancelling %d requests still in flight", adm.active)
        if self._http is not None:
            await self._http.stop()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)
        self.rt.metrics.close()
        log.info("stopped")


async def serve(config: ServerConfig, make: Callable[[ServerConfig], BatonServer] = BatonServer) -> int:
    """Run until SIGTERM/SIGINT, then drain; 0 on a clean stop. `make` builds the server (CoEServer)."""
    server = make(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    loading, stopping = asyncio.create_task(server.load()), asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            loading.result()  # a checkpoint that fails to load ends the process with its error
            await stopping
        log.info("shutting down (signal received)")
    finally:
        loading.cancel()
        stopping.cancel()
        await server.drain_and_stop()
    return 0


def run(config: ServerConfig, make: Callable[[ServerConfig], BatonServer] = BatonServer) -> int:
    return asyncio.run(serve(config, make))
