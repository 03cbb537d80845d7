"""The HTTP door, as serve/gate.py is gRPC's: bearer-token auth, then "are we taking work?".

A plain ASGI middleware (no per-request task, unlike Starlette's BaseHTTPMiddleware, so streams
are untouched). /health skips both checks: probes carry no token and must see 503 while the model
loads or the server drains. Bodies larger than the server's message limit are refused up front.
"""

from __future__ import annotations

import hmac

import grpc
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from baton.serve.gate import REFUSALS
from baton.serve.openai.protocol import error_body
from baton.serve.runtime import Runtime

OPEN_PATHS = ("/health",)


class PeerContext:
    """What Runtime.request reads from a gRPC context, for an HTTP request."""

    def __init__(self, client):
        self._peer = f"{client.host}:{client.port}" if client else "-"

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> None:  # HTTP has no deadline on the wire
        return None


def _length(headers: dict) -> int:
    """The declared body size; a malformed Content-Length is left to the HTTP parser (uvicorn: 400)."""
    try:
        return int(headers.get(b"content-length", b"0") or 0)
    except ValueError:
        return 0


class HttpGate:
    def __init__(self, app: ASGIApp, runtime: Runtime, token: str | None):
        self.app, self.rt = app, runtime
        self._expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = None
        if self._expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
            why = "missing or wrong bearer token (header 'Authorization: Bearer <token>')"
            refusal = (401, grpc.StatusCode.UNAUTHENTICATED, why)
        elif self.rt.state != "serving":
            why = REFUSALS[self.rt.state] + (f": {self.rt.failure_reason}" if self.rt.state == "failed" else "")
            refusal = (503, grpc.StatusCode.UNAVAILABLE, why)
        elif _length(headers) > self.rt.limits.max_message_bytes:
            why = f"request body is larger than this server's limit of {self.rt.limits.max_message_bytes} bytes"
            refusal = (413, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, code, why = refusal
        client = scope.get("client")
        self.rt.reject(f"openai{scope['path']}", code, f"{client[0]}:{client[1]}" if client else "-", why)
        extra = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        await JSONResponse(error_body(status, why), status_code=status, headers=extra)(scope, receive, send)
