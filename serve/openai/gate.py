"""The HTTP door, as serve/gate.py is gRPC's: bearer-token auth, then "are we taking work?".

A plain ASGI middleware (no per-request task, unlike Starlette's BaseHTTPMiddleware, so streams
are untouched). /health skips both checks: probes carry no token and must see 503 while the model
loads or the server drains. Bodies larger than the server's message limit are refused up front.

It also keeps the promise of one log line per request: a POST whose handler never reached a
generation (a bad body, a bad parameter, an internal error) is accounted here, with the outcome
its HTTP status means and the error's type.
"""

from __future__ import annotations

import asyncio
import hmac

import grpc
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from baton.serve.gate import REFUSALS
from baton.serve.openai.protocol import error_body
from baton.serve.runtime import LEDGER, Ledger, Runtime

OPEN_PATHS = ("/health",)
OUTCOMES = {400: "invalid_argument", 401: "unauthenticated", 404: "not_found", 405: "unimplemented"}
OUTCOMES |= {413: "resource_exhausted", 429: "resource_exhausted", 503: "unavailable"}


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


def outcome_of(status: int, error: BaseException | None) -> str:
    """The request log's outcome (a gRPC status name, as Runtime.request writes) for an HTTP answer."""
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    if status < 400:
        return "ok"
    return OUTCOMES.get(status, "internal" if status >= 500 else "invalid_argument")


class HttpGate:
    def __init__(self, app: ASGIApp, runtime: Runtime, token: str | None, routes: tuple[str, ...]):
        self.app, self.rt, self.routes = app, runtime, routes
        self._expected = f"Bearer {token}".encode() if token else None

    def _api(self, scope: Scope) -> str:
        """The metrics label: the route, or one label for every unknown path (labels stay bounded)."""
        return f"openai{scope['path']}" if scope["path"] in self.routes else "openai/unknown"

    async def _accounted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; if no generation wrote this request's log line, write it here, before the
        answer's last byte leaves (a client that reads the answer can then read the line)."""
        ledger, status = Ledger(), 500  # 500: the app raised before it answered
        token = LEDGER.set(ledger)

        async def tracked(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body") and not ledger.logged:
                self._log(scope, status, ledger)
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except BaseException as e:
            ledger.error = ledger.error or e
            raise
        finally:
            LEDGER.reset(token)
            if not ledger.logged:
                self._log(scope, status, ledger)

    def _log(self, scope: Scope, status: int, ledger: Ledger) -> None:
        e = ledger.error
        why = f"HTTP {status}" + (f": {e}" if e is not None and str(e) else "")
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "-"
        self.rt.reject(self._api(scope), outcome_of(status, e), peer, why[:500], type(e).__name__ if e else None)
        ledger.logged += 1

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
        if refusal is None and scope["method"] == "GET":  # /v1/models: no request line, as gRPC's ModelInfo
            return await self.app(scope, receive, send)
        if refusal is None:
            return await self._accounted(scope, receive, send)
        status, code, why = refusal
        client = scope.get("client")
        self.rt.reject(self._api(scope), code, f"{client[0]}:{client[1]}" if client else "-", why)
        extra = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        await JSONResponse(error_body(status, why), status_code=status, headers=extra)(scope, receive, send)
