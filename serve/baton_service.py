"""baton.serve.v1.BatonService: streaming generation, tokenization, model and server info."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from contextlib import aclosing
from typing import AsyncIterator

import grpc
from baton.serve import proto
from baton.serve.core.stats import EngineStats
from baton.serve.outputs import RequestOutput
from baton.serve.request_params import from_proto
from baton.serve.rpc import RpcError, invalid, parse, service_handler
from baton.serve.runtime import VERSION, Runtime
from google.protobuf.message import Message

GenerateRequest, GenerateResponse = proto.baton("GenerateRequest"), proto.baton("GenerateResponse")


def generate_response(out: RequestOutput, delta: bool, model: str = "") -> Message:
    """One streamed message (new text and tokens since the last one) or the whole output."""
    msg = GenerateResponse(request_id=out.request_id, finished=out.finished, model=model)
    for c in out.outputs:
        ids = c.delta_token_ids if delta else c.token_ids
        comp = msg.completions.add(
            index=c.index, text=c.delta_text if delta else c.text, token_ids=ids, finish_reason=c.finish_reason or ""
        )
        if c.logprobs is not None:
            for lp in c.logprobs[len(c.logprobs) - len(ids) :]:
                comp.logprobs.add().logprobs.update(lp)
        if isinstance(c.stop_reason, str):
            comp.stop_string = c.stop_reason
        elif c.stop_reason is not None:
            comp.stop_token_id = c.stop_reason
    if out.finished:
        m = out.metrics
        msg.usage.prompt_tokens = m.num_prompt_tokens
        msg.usage.completion_tokens = m.num_generated_tokens
        msg.usage.cached_prompt_tokens = m.num_cached_prompt_tokens
    return msg


class BatonService:
    def __init__(self, runtime: Runtime):
        self.rt = runtime

    def handler(self) -> grpc.GenericRpcHandler:
        return service_handler(
            proto.BATON_SERVICE,
            unary={
                "Tokenize": self.tokenize,
                "Detokenize": self.detokenize,
                "ModelInfo": self.model_info,
                "ServerInfo": self.server_info,
            },
            server_streaming={"Generate": self.generate},
        )

    async def generate(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        async with self.rt.request("baton.serve.v1.BatonService/Generate", context) as call:
            req = parse(GenerateRequest, data)
            self.rt.check_model(req.model)
            which = req.WhichOneof("prompt")
            if which is None:
                raise invalid("prompt: set text or token_ids")
            prompt = req.text if which == "text" else list(req.token_ids.ids)
            rt = await self.rt.route(call, req.model, prompt)
            last = None
            async with aclosing(rt.generate(call, prompt, from_proto(req.sampling), req.priority)) as stream:
                async for out in stream:
                    if req.unary:
                        last = out
                    else:
                        yield generate_response(out, delta=True, model=rt.model_name)
            if last is not None:
                yield generate_response(last, delta=False, model=rt.model_name)

    @staticmethod
    def _tokenizer(rt: Runtime):
        tok = rt.core.tokenizer
        if tok is None:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer: use token ids")
        return tok

    async def tokenize(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        req = parse(proto.baton("TokenizeRequest"), data)
        return proto.baton("TokenizeResponse")(token_ids=self._tokenizer(self.rt.resolve(req.model)).encode(req.text))

    async def detokenize(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        req = parse(proto.baton("DetokenizeRequest"), data)
        rt = self.rt.resolve(req.model)
        vocab = rt.core.vocab_size
        bad = next((t for t in req.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"token_ids: {bad} is outside the vocabulary (0..{vocab - 1})")
        text = self._tokenizer(rt).decode(list(req.token_ids), skip_special_tokens=not req.keep_special_tokens)
        return proto.baton("DetokenizeResponse")(text=text)

    async def model_info(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        req = parse(proto.baton("ModelInfoRequest"), data)
        rt = self.rt.resolve(req.model)
        core = rt.core
        cfg = core.model.config
        weight = next(core.model.parameters())
        spec = core.config.speculative
        spec_mode = "none" if spec is None else spec.describe()
        return proto.baton("ModelInfoResponse")(
            name=rt.model_name,
            architecture=cfg.model_type or cfg.infer_model_type(),
            config_json=json.dumps(cfg.to_dict(), sort_keys=True),
            max_context=core.max_model_len,
            dtype=str(weight.dtype).removeprefix("torch."),
            quantization=rt.quantization,
            speculative_mode=spec_mode,
            vocab_size=core.vocab_size,
            kv_block_size=core.config.block_size,
            kv_blocks=core.block_manager.num_blocks,
            device=str(weight.device),
        )

    async def server_info(self, data: bytes, context: grpc.aio.ServicerContext) -> Message:
        parse(proto.baton("ServerInfoRequest"), data)
        stats = await asyncio.to_thread(self.rt.engine_stats)  # waits for the engine lock: off the loop
        return proto.baton("ServerInfoResponse")(**server_info_fields(self.rt, stats))


def server_info_fields(rt: Runtime, stats: EngineStats | None) -> dict:
    """ServerInfoResponse's fields: the server's own, then the engine's by name (none while loading)."""
    own = dict(
        version=VERSION, uptime_s=time.monotonic() - rt.started, state=rt.state, failure_reason=rt.failure_reason or ""
    )
    coe = rt.composition_info()
    if coe is not None:
        own["coe"] = coe
    return own if stats is None else {**own, **dataclasses.asdict(stats)}
