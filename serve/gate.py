"""The door every call passes: bearer-token auth, then "are we taking work?".

Health checks skip both (Kubernetes probes carry no token and must see NOT_SERVING while we
load or drain); reflection and the KServe liveness/readiness calls skip the state check, so
they answer truthfully during loading and draining. A refused call never reaches a handler.
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

import grpc

from baton.serve.runtime import Runtime

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFUSALS = {
    "loading": "the model is still loading",
    "draining": "the server is shutting down",
    "failed": "the engine failed; the server must be restarted",
}
ALWAYS_OPEN = (
    "/grpc.reflection.",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/inference.GRPCInferenceService/ModelReady",
    "/baton.serve.v1.BatonService/ServerInfo",
)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as the real one that only refuses."""

    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class Gate(grpc.aio.ServerInterceptor):
    def __init__(self, runtime: Runtime, token: str | None):
        self.rt = runtime
        self._expected = f"Bearer {token}".encode() if token else None

    def _authorized(self, metadata) -> bool:
        got = next((v for k, v in metadata or () if k == "authorization"), "")
        got = got.encode() if isinstance(got, str) else got
        return hmac.compare_digest(got, self._expected)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        if self._expected is not None and not self._authorized(details.invocation_metadata):
            why = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"
            return self._refuse(handler, method, grpc.StatusCode.UNAUTHENTICATED, why)
        if self.rt.state != "serving" and not method.startswith(ALWAYS_OPEN):
            why = REFUSALS[self.rt.state]
            if self.rt.state == "failed":
                why += f": {self.rt.failure_reason}"
            return self._refuse(handler, method, grpc.StatusCode.UNAVAILABLE, why)
        return handler

    def _refuse(
        self, handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode, why: str
    ) -> grpc.RpcMethodHandler:
        self.rt.reject(method.strip("/"), code, "-", why)
        return _refusal(handler, code, why)
