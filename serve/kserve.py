"""inference.GRPCInferenceService (KServe v2, Triton flavour) over the same runtime.

Streaming follows Triton's decoupled-model convention: ModelStreamInfer answers each request
with responses carrying `text_output` deltas, the last one marked by the `triton_final_response`
parameter (or, if the client set `triton_enable_empty_final_response`, an extra empty response so
marked). A failed request gets a response with `error_message` and the stream stays open.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator

import grpc
from google.protobuf.message import Message

from baton.serve import proto
from baton.serve.kserve_tensors import INPUTS, OUTPUT, LLMRequest, fill_response, parse_llm_request
from baton.serve.rpc import RpcError, invalid, parse, service_handler, status_of
from baton.serve.runtime import VERSION, Call, Runtime

ModelInferRequest, ModelInferResponse = proto.kserve("ModelInferRequest"), proto.kserve("ModelInferResponse")
StreamResponse = proto.kserve("ModelStreamInferResponse")
_DONE = object()


class KServeService:
    def __init__(self, runtime: Runtime):
        self.rt = runtime

    def handler(self) -> grpc.GenericRpcHandler:
        return service_handler(
            proto.KSERVE_SERVICE,
            unary={
                "ServerLive": self.server_live,
                "ServerReady": self.server_ready,
                "ModelReady": self.model_ready,
                "ServerMetadata": self.server_metadata,
                "ModelMetadata": self.model_metadata,
                "ModelInfer": self.model_infer,
                "RepositoryIndex": self.repository_index,
                "RepositoryModelLoad": self.repository_model_load,
                "RepositoryModelUnload": self.repository_model_unload,
            },
            bidi_streaming={"ModelStreamInfer": self.model_stream_infer},
        )

    # ------------------------------------------------------------------------------ status
    async def server_live(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        parse(proto.kserve("ServerLiveRequest"), data)
        return proto.kserve("ServerLiveResponse")(live=True)

    async def server_ready(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        parse(proto.kserve("ServerReadyRequest"), data)
        return proto.kserve("ServerReadyResponse")(ready=self.rt.state == "serving")

    async def model_ready(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        req = parse(proto.kserve("ModelReadyRequest"), data)
        try:
            rt = self.rt.resolve(req.name, req.version)
        except RpcError as e:
            if e.code != grpc.StatusCode.UNAVAILABLE:  # unknown: NOT_FOUND; known but not loaded: not ready
                raise
            return proto.kserve("ModelReadyResponse")(ready=False)
        return proto.kserve("ModelReadyResponse")(ready=self.rt.state == "serving" and rt.state == "serving")

    async def server_metadata(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        parse(proto.kserve("ServerMetadataRequest"), data)
        return proto.kserve("ServerMetadataResponse")(name="baton", version=VERSION, extensions=[])

    async def model_metadata(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        req = parse(proto.kserve("ModelMetadataRequest"), data)
        self.rt.resolve(req.name, req.version)
        resp = proto.kserve("ModelMetadataResponse")(
            name=req.name or self.rt.model_name, versions=["1"], platform="baton"
        )
        for name, dtype in INPUTS.items():
            resp.inputs.add(name=name, datatype=dtype, shape=[1])
        resp.outputs.add(name=OUTPUT, datatype="BYTES", shape=[-1])
        return resp

    # ------------------------------------------------------------------------------ repository
    async def repository_index(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        req = parse(proto.kserve("RepositoryIndexRequest"), data)
        resp = proto.kserve("RepositoryIndexResponse")()
        for name, state, reason in self.rt.repository_index():
            if state == "READY" or not req.ready:
                resp.models.add(name=name, version="1", state=state, reason=reason)
        return resp

    async def repository_model_load(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        """Load a model by name; a `config` parameter (JSON, Triton's convention) adds a new one."""
        req = parse(proto.kserve("RepositoryModelLoadRequest"), data)
        config = req.parameters["config"].string_param if "config" in req.parameters else None
        await self.rt.load_model(req.model_name, config)
        return proto.kserve("RepositoryModelLoadResponse")()

    async def repository_model_unload(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        """Stop routing to the model, let its in-flight requests finish, then free it; others go on."""
        req = parse(proto.kserve("RepositoryModelUnloadRequest"), data)
        await self.rt.unload_model(req.model_name)
        return proto.kserve("RepositoryModelUnloadResponse")()

    # ------------------------------------------------------------------------------ inference
    def _response(self, req: Message, model: str, texts: list[str] | None, final: bool | None) -> Message:
        """`model`: the model that generated (under a CoE, the expert the router chose)."""
        return fill_response(ModelInferResponse(model_name=model, model_version="1", id=req.id), texts, final)

    async def _run(
        self, call: Call, req: Message, streaming_rpc: bool
    ) -> AsyncIterator[tuple[LLMRequest, str, list[str], bool]]:
        """(parsed request, model, texts, finished) per step when streaming, else once with the whole text."""
        self.rt.check_model(req.model_name, req.model_version)
        r = parse_llm_request(req)
        if r.stream and not streaming_rpc:
            raise invalid("input 'stream' is true: streaming needs ModelStreamInfer")
        rt = await self.rt.route(call, req.model_name, r.prompt, req.model_version)
        prefix = "" if r.exclude_input else r.prompt
        last = None
        async with aclosing(rt.generate(call, r.prompt, r.params)) as stream:
            async for out in stream:
                if r.stream:
                    yield r, rt.model_name, [prefix + c.delta_text for c in out.outputs], out.finished
                    prefix = ""
                last = out
        if not r.stream:
            yield r, rt.model_name, [prefix + c.text for c in last.outputs], True

    async def model_infer(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        async with self.rt.request("inference.GRPCInferenceService/ModelInfer", context) as call:
            req = parse(ModelInferRequest, data)
            async with aclosing(self._run(call, req, streaming_rpc=False)) as steps:
                async for _, model, texts, _ in steps:
                    return self._response(req, model, texts, None)

    async def _stream_one(self, data: bytes, context: grpc.aio.ServicerContext, out: asyncio.Queue) -> None:
        req_id = ""
        try:
            async with self.rt.request("inference.GRPCInferenceService/ModelStreamInfer", context) as call:
                req = parse(ModelInferRequest, data)
                req_id = req.id
                async with aclosing(self._run(call, req, streaming_rpc=True)) as steps:
                    async for r, model, texts, finished in steps:
                        if any(texts) or (finished and not r.empty_final):
                            resp = self._response(req, model, texts, finished and not r.empty_final)
                            out.put_nowait(StreamResponse(infer_response=resp))
                        if finished and r.empty_final:
                            out.put_nowait(StreamResponse(infer_response=self._response(req, model, None, True)))
        except Exception as e:  # noqa: BLE001 - the error goes to this request only
            message = status_of(e)[1]
            out.put_nowait(StreamResponse(error_message=f"request {req_id!r}: {message}" if req_id else message))
        finally:
            out.put_nowait(_DONE)

    async def model_stream_infer(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Message]:
        """Requests on one stream run concurrently; their responses interleave."""
        out: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        producers = 1  # the reader, then one per request

        async def read() -> None:
            nonlocal producers
            try:
                async for data in requests:
                    producers += 1
                    tasks.add(asyncio.create_task(self._stream_one(data, context, out)))
            finally:
                out.put_nowait(_DONE)

        reader = asyncio.create_task(read())
        try:
            while producers:
                item = await out.get()
                if item is _DONE:
                    producers -= 1
                else:
                    yield item
        finally:
            for t in (reader, *tasks):
                t.cancel()
