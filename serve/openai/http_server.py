"""The HTTP front's life cycle inside `baton serve`: uvicorn on the server's own event loop.

Bound before the model loads (requests get 503 until it is), like the gRPC port; stopped after
the drain, so in-flight streams finish first. uvicorn's own signal handling is left out: the
server's SIGTERM/SIGINT handler drains both fronts together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from baton.serve.engine import LLMEngine
from baton.serve.openai.app import OpenAIFront
from baton.serve.openai.tool_calling import AgentConfig
from baton.serve.runtime import Runtime

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the Baton server owns the signals
        yield


class HttpFront:
    def __init__(
        self,
        runtime: Runtime,
        model_dir: str,
        host: str,
        port: int,
        auth_token: str | None = None,
        tls: tuple[str, str] | None = None,
        agents: AgentConfig | None = None,
    ):
        self.host, self.tls = host, tls
        self.front = OpenAIFront(runtime, model_dir, auth_token, agents)
        app = self.front.app()
        cert, key = tls or (None, None)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=cert,
            ssl_keyfile=key,
            timeout_graceful_shutdown=1,
        )
        self._server = _Server(config)
        self._socket = self._bind(host, port)
        self.port: int = self._socket.getsockname()[1]
        self._task: asyncio.Task | None = None

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto=IPPROTO_TCP, as getaddrinfo would give: asyncio sets TCP_NODELAY on accepted connections only
        # then, and without it each SSE event after the headers waits ~40 ms for the client's delayed ACK
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise ValueError(f"cannot serve HTTP on {host}:{port}: {e}") from None
        sock.set_inheritable(True)
        return sock

    def prepare(self, engine: LLMEngine) -> None:
        """What requests share, built once when the model loads (see OpenAIFront.prepare)."""
        self.front.prepare(engine)

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():  # e.g. a bad TLS file
                self._task.result()
                raise ValueError("the HTTP front stopped while starting")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if self.tls else "http", self.host, self.port)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
