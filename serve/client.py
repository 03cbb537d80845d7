"""Python clients for Baton's gRPC API: `BatonClient` (blocking) and `AsyncBatonClient` (asyncio).

    with BatonClient("127.0.0.1:8001") as c:
        for msg in c.generate("Once upon a time", max_tokens=32, temperature=0):
            print(msg.completions[0].text, end="", flush=True)

Sampling keyword arguments are SamplingParams' fields (see sampling.proto). Messages are the
protobuf messages of baton/serve/v1/baton.proto. Errors raise grpc.RpcError with the status code.
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from baton.serve import proto

_METHODS = {  # name -> (response streams?, request type, response type)
    "Generate": (True, "GenerateRequest", "GenerateResponse"),
    "Tokenize": (False, "TokenizeRequest", "TokenizeResponse"),
    "Detokenize": (False, "DetokenizeRequest", "DetokenizeResponse"),
    "ModelInfo": (False, "ModelInfoRequest", "ModelInfoResponse"),
    "ServerInfo": (False, "ServerInfoRequest", "ServerInfoResponse"),
}


def generate_request(
    prompt: str | list[int], unary: bool = False, model: str = "", priority: int = 0, **sampling
) -> Message:
    req = proto.baton("GenerateRequest")(
        model=model, unary=unary, priority=priority, sampling=proto.baton("SamplingParams")(**sampling)
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _serialize(msg: Message) -> bytes:
    return msg.SerializeToString()


class _Base:
    def __init__(self, channel, token: str | None, timeout: float | None):
        self.channel = channel
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._calls = {}
        for name, (streams, _, resp) in _METHODS.items():
            make = channel.unary_stream if streams else channel.unary_unary
            self._calls[name] = make(
                f"/{proto.BATON_SERVICE}/{name}",
                request_serializer=_serialize,
                response_deserializer=proto.baton(resp).FromString,
            )
        self._health = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )

    def _invoke(self, name: str, request: Message, timeout: float | None):
        return self._calls[name](request, timeout=timeout or self.timeout, metadata=self.metadata)


def _credentials(ca_file: str | None) -> grpc.ChannelCredentials | None:
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes()) if ca_file else None


class BatonClient(_Base):
    def __init__(
        self,
        target: str = "127.0.0.1:8001",
        *,
        token: str | None = None,
        ca_file: str | None = None,
        timeout: float | None = None,
        options: list[tuple[str, object]] | None = None,
    ):
        creds = _credentials(ca_file)
        channel = grpc.secure_channel(target, creds, options) if creds else grpc.insecure_channel(target, options)
        super().__init__(channel, token, timeout)

    def generate(self, prompt: str | list[int], *, timeout: float | None = None, **kwargs) -> Iterator[Message]:
        """Stream GenerateResponse messages; closing the iterator early cancels the request."""
        call = self._invoke("Generate", generate_request(prompt, **kwargs), timeout)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str | list[int], *, timeout: float | None = None, **kwargs) -> Message:
        """The whole output as one GenerateResponse (unary mode). The stream is read to its end (the
        call's status): a call dropped after its one message is cancelled by gRPC, and the server
        could count it so before it had finished the call."""
        (out,) = self._invoke("Generate", generate_request(prompt, unary=True, **kwargs), timeout)
        return out

    def tokenize(self, text: str) -> list[int]:
        return list(self._invoke("Tokenize", proto.baton("TokenizeRequest")(text=text), None).token_ids)

    def detokenize(self, token_ids: list[int], keep_special_tokens: bool = False) -> str:
        req = proto.baton("DetokenizeRequest")(token_ids=token_ids, keep_special_tokens=keep_special_tokens)
        return self._invoke("Detokenize", req, None).text

    def model_info(self) -> Message:
        return self._invoke("ModelInfo", proto.baton("ModelInfoRequest")(), None)

    def server_info(self) -> Message:
        return self._invoke("ServerInfo", proto.baton("ServerInfoRequest")(), None)

    def health(self, service: str = "") -> str:
        """'SERVING' or 'NOT_SERVING' (health checks need no token)."""
        resp = self._health(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "BatonClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncBatonClient(_Base):
    def __init__(
        self,
        target: str = "127.0.0.1:8001",
        *,
        token: str | None = None,
        ca_file: str | None = None,
        timeout: float | None = None,
        options: list[tuple[str, object]] | None = None,
    ):
        creds = _credentials(ca_file)
        channel = (
            grpc.aio.secure_channel(target, creds, options) if creds else grpc.aio.insecure_channel(target, options)
        )
        super().__init__(channel, token, timeout)

    async def generate(
        self, prompt: str | list[int], *, timeout: float | None = None, **kwargs
    ) -> AsyncIterator[Message]:
        """Stream GenerateResponse messages; leaving the loop early cancels the request."""
        call = self._invoke("Generate", generate_request(prompt, **kwargs), timeout)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    async def complete(self, prompt: str | list[int], *, timeout: float | None = None, **kwargs) -> Message:
        call = self._invoke("Generate", generate_request(prompt, unary=True, **kwargs), timeout)
        return await call.read()

    async def tokenize(self, text: str) -> list[int]:
        return list((await self._invoke("Tokenize", proto.baton("TokenizeRequest")(text=text), None)).token_ids)

    async def detokenize(self, token_ids: list[int], keep_special_tokens: bool = False) -> str:
        req = proto.baton("DetokenizeRequest")(token_ids=token_ids, keep_special_tokens=keep_special_tokens)
        return (await self._invoke("Detokenize", req, None)).text

    async def model_info(self) -> Message:
        return await self._invoke("ModelInfo", proto.baton("ModelInfoRequest")(), None)

    async def server_info(self) -> Message:
        return await self._invoke("ServerInfo", proto.baton("ServerInfoRequest")(), None)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncBatonClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
