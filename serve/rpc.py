"""gRPC plumbing shared by the services: status errors, request parsing, handler tables.

Handlers receive the raw request bytes and parse them themselves, so a malformed message (bad
wire format, non-UTF-8 in a string field) is answered with INVALID_ARGUMENT naming the problem
instead of gRPC's generic deserialization failure.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError, Message


class RpcError(Exception):
    """Raised by handlers; the call ends with this status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def invalid(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def parse(cls: type[Message], data: bytes) -> Message:
    try:
        return cls.FromString(data)
    except DecodeError as e:
        raise invalid(f"malformed {cls.DESCRIPTOR.name}: {e}") from None


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a handler exception becomes. ValueError is the engine's word for bad input."""
    if isinstance(exc, RpcError):
        return exc.code, exc.message
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"


def _aborting(fn: Callable) -> Callable:
    """Turn exceptions into context.abort(status) for unary and streaming handlers alike."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(request: Any, context: grpc.aio.ServicerContext):
            try:
                async for item in fn(request, context):
                    yield item
            except Exception as e:  # noqa: BLE001 - every failure must become a status
                await context.abort(*status_of(e))

        return stream

    @functools.wraps(fn)
    async def unary(request: Any, context: grpc.aio.ServicerContext):
        try:
            return await fn(request, context)
        except Exception as e:  # noqa: BLE001
            await context.abort(*status_of(e))

    return unary


def _serialize(msg: Message) -> bytes:
    return msg.SerializeToString()


def service_handler(
    service: str,
    unary: dict[str, Callable],
    server_streaming: dict[str, Callable] | None = None,
    bidi_streaming: dict[str, Callable] | None = None,
) -> grpc.GenericRpcHandler:
    """A handler table for one service; requests arrive as bytes (see `parse`)."""
    table = {
        name: grpc.unary_unary_rpc_method_handler(_aborting(fn), response_serializer=_serialize)
        for name, fn in unary.items()
    }
    for name, fn in (server_streaming or {}).items():
        table[name] = grpc.unary_stream_rpc_method_handler(_aborting(fn), response_serializer=_serialize)
    for name, fn in (bidi_streaming or {}).items():
        table[name] = grpc.stream_stream_rpc_method_handler(_aborting(fn), response_serializer=_serialize)
    return grpc.method_handlers_generic_handler(service, table)
