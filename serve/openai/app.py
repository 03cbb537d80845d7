"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /health.

FastAPI (on Starlette, served by uvicorn; see serve/openai/http_server.py) because it is the
maintained ASGI stack that vLLM and SGLang also build their OpenAI fronts on: pydantic request
models, and server-sent events through StreamingResponse, with client disconnects delivered as
cancellation (which aborts the engine request and frees its KV blocks). Every generation goes
through serve/runtime.Runtime, as gRPC calls do: the same limits, admission (429 when full),
metrics and request log line. Errors are OpenAI's JSON {"error": {message, type, param, code}}.
Chat (and /v1/responses, serve/openai/responses_api.py) runs each request as a
serve/openai/tool_calling.ChatTurn: tools, tool_choice and reasoning (docs/agents.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from baton.serve.async_engine import EngineDeadError, RequestFailedError
from baton.serve.engine import LLMEngine
from baton.serve.openai import responses as R
from baton.serve.openai.chat import NoChatTemplate
from baton.serve.openai.echo import prompt_logprobs
from baton.serve.openai.gate import HttpGate, PeerContext
from baton.serve.openai.protocol import (
    DONE,
    BadParam,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    param_of,
    sampling_params,
    sse,
)
from baton.serve.openai.responses_api import ResponsesRoute
from baton.serve.openai.tool_calling import AgentConfig, Agents, ChatTurn
from baton.serve.outputs import RequestOutput
from baton.serve.rpc import RpcError
from baton.serve.runtime import Runtime, note_error
from baton.serve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/responses")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(e: Exception, fields: set[str] = frozenset()) -> JSONResponse:
    """The HTTP status and OpenAI error body for an exception a handler raised."""
    note_error(e)
    param = None
    if isinstance(e, BadParam):
        status, message, param = 400, str(e), e.param
    elif isinstance(e, NoChatTemplate):
        status, message, param = 400, str(e), "messages"
    elif isinstance(e, RpcError):
        status, message = HTTP_STATUS.get(e.code, 500), e.message
        param = "model" if e.code == grpc.StatusCode.NOT_FOUND else param_of(message, fields)
    elif isinstance(e, EngineDeadError):
        status, message = 503, str(e)
    elif isinstance(e, RequestFailedError):
        status, message = 500, str(e)
    elif isinstance(e, ValueError):  # the engine's word for bad input
        status, message = 400, str(e)
        param = "messages" if message.startswith("messages") else param_of(message, fields)
    else:
        status, message = 500, f"internal error: {e!r}"
        log.error("internal error answering an HTTP request", exc_info=e)
    return JSONResponse(error_body(status, message, param), status_code=status)


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


async def _prime(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's first output: every check and the admission happen before a header is sent."""
    tasks = [asyncio.ensure_future(anext(g)) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
        raise


async def _merge(firsts: list[RequestOutput], gens: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; closing this closes them all."""
    for p, first in enumerate(firsts):
        yield p, first
    live = [p for p, f in enumerate(firsts) if not f.finished]
    if len(live) == 1:  # the usual case: no tasks needed
        async with aclosing(gens[live[0]]) as g:
            async for out in g:
                yield live[0], out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int) -> None:
        try:
            async for out in gens[p]:
                queue.put_nowait((p, out))
            queue.put_nowait((p, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((p, e))

    tasks = [asyncio.ensure_future(pump(p)) for p in live]
    try:
        remaining = len(tasks)
        while remaining:
            p, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield p, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


class OpenAIFront:
    def __init__(
        self, runtime: Runtime, model_dir: str, auth_token: str | None = None, agents: AgentConfig | None = None
    ):
        self.rt, self.model_dir, self.auth_token = runtime, model_dir, auth_token
        self.agent_config = agents or AgentConfig()
        self.agents: Agents | None = None  # built by prepare(), when the model has loaded

    def prepare(self, engine: LLMEngine) -> None:
        """Load and compile the chat template and the parsers now, not inside the first chat
        requests (several at once on a fresh server raced transformers' first import)."""
        self.agents = Agents(self.agent_config, self.model_dir, engine.tokenizer, engine.eos_ids, self.rt.metrics)

    def app(self) -> FastAPI:
        app = FastAPI(title="Baton OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(HttpGate, runtime=self.rt, token=self.auth_token, routes=ROUTES)

        @app.exception_handler(RequestValidationError)
        async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
            note_error(exc)
            err = exc.errors()[0]
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = loc[0] if loc else None
            where = ".".join(loc) or "body"
            return JSONResponse(error_body(400, f"{where}: {err.get('msg', 'invalid')}", param), status_code=400)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
            note_error(exc)
            status = exc.status_code
            return JSONResponse(error_body(status, str(exc.detail)), status_code=status)

        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        ResponsesRoute(self, error_response).register(app)  # POST /v1/responses, GET/DELETE /v1/responses/{id}
        return app

    # ------------------------------------------------------------------------------ routes
    async def health(self) -> Response:
        """200 while serving, else 503 (probes carry no token: the gate lets /health through)."""
        return JSONResponse({"status": self.rt.state}, status_code=200 if self.rt.state == "serving" else 503)

    async def models(self) -> JSONResponse:
        card = {
            "id": self.rt.model_name,
            "object": "model",
            "created": int(time.time() - (time.monotonic() - self.rt.started)),
            "owned_by": "baton",
            "root": self.model_dir,
            "max_model_len": self.rt.core.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, req: CompletionRequest, http: Request) -> Response:
        fields = set(CompletionRequest.model_fields)
        try:
            self.rt.check_model(req.model)
            if req.suffix:
                raise BadParam("suffix is not supported by this server", "suffix")
            if req.best_of not in (None, req.n):
                raise BadParam("best_of other than n is not supported by this server", "best_of")
            params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
            prompts = _prompts(req.prompt)
            if not prompts:
                raise BadParam("prompt is empty", "prompt")
            gens = [self._generate("openai/v1/completions", p, params, http) for p in prompts]
            firsts = await _prime(gens)
            try:
                echoed = await self._echo(firsts, req)
            except BaseException:
                for g in gens:  # admitted and running: abort them
                    await g.aclose()
                raise
            rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
            head = R.header(rid, "text_completion", created, self.rt.model_name)
            if req.stream:
                usage = req.stream_options is not None and req.stream_options.include_usage
                body = self._completion_events(head, firsts, gens, params, echoed, usage)
                return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
            finals = await asyncio.gather(*(self._last(f, g) for f, g in zip(firsts, gens)))
        except Exception as e:  # noqa: BLE001 - every failure becomes OpenAI's error JSON
            return error_response(e, fields)
        tok = self.rt.core.tokenizer
        choices = []
        for p, out in enumerate(finals):
            prefix_text, prefix_lp = echoed[p]
            for c in out.outputs:
                lp = None
                if params.logprobs is not None:
                    ids = (out.prompt_token_ids if req.echo else []) + c.token_ids
                    lps = (prefix_lp if req.echo else []) + R.new_logprobs(c, c.token_ids)
                    lp = R.completion_logprobs(tok, ids, lps, k=params.logprobs)
                choices.append(
                    {
                        "index": p * params.n + c.index,
                        "text": prefix_text + c.text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                )
        return JSONResponse({**head, "choices": choices, "usage": R.usage(finals)})

    async def chat(self, req: ChatCompletionRequest, http: Request) -> Response:
        fields = set(ChatCompletionRequest.model_fields)
        try:
            self.rt.check_model(req.model)
            if req.top_logprobs is not None and not req.logprobs:
                raise BadParam("top_logprobs needs logprobs: true", "top_logprobs")
            if self.rt.core.tokenizer is None:
                raise BadParam("this model has no tokenizer: chat needs one", "messages")
            turn = self.agents.turn(
                req.messages,
                tools=req.tools,
                tool_choice=req.tool_choice,
                parallel_tool_calls=req.parallel_tool_calls,
                chat_template_kwargs=req.chat_template_kwargs,
                thinking_budget=req.thinking_token_budget,
            )
            ids = await asyncio.to_thread(turn.render)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            if max_tokens is None:  # OpenAI's default: what the context leaves
                max_tokens = max(1, min(self.rt.limits.max_output_tokens, self.rt.core.max_model_len - len(ids)))
            k = (req.top_logprobs or 0) if req.logprobs else None
            try:
                params = sampling_params(req, max_tokens, k)
            except BadParam as e:
                raise (
                    BadParam(str(e).replace("logprobs", "top_logprobs", 1), "top_logprobs")
                    if (e.param == "logprobs")
                    else e
                )
            turn.apply(params)
            gens = [self._generate("openai/v1/chat/completions", ids, params, http)]
            firsts = await _prime_turn(turn, gens)
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            if req.stream:
                usage = req.stream_options is not None and req.stream_options.include_usage
                head = R.header(rid, "chat.completion.chunk", created, self.rt.model_name)
                body = self._chat_events(head, firsts[0], gens[0], params, turn, usage)
                return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
            out = await self._last(firsts[0], gens[0])
        except Exception as e:  # noqa: BLE001
            return error_response(e, fields)
        tok, choices = self.rt.core.tokenizer, []
        for c in out.outputs:
            result = turn.parse(c)
            lp = None if k is None else R.chat_logprobs(tok, c.token_ids, R.new_logprobs(c, c.token_ids), k)
            choices.append(
                {
                    "index": c.index,
                    "message": result.to_chat(turn.with_reasoning),
                    "logprobs": lp,
                    "finish_reason": result.finish_reason,
                }
            )
        head = R.header(rid, "chat.completion", created, self.rt.model_name)
        return JSONResponse({**head, "choices": choices, "usage": R.usage([out])})

    # ------------------------------------------------------------------------------ plumbing
    async def _generate(
        self, api: str, prompt: str | list[int], params: SamplingParams, http: Request
    ) -> AsyncIterator[RequestOutput]:
        """One engine request, accounted like a gRPC call (admission, metrics, log line)."""
        async with self.rt.request(api, PeerContext(http.client)) as call:
            async with aclosing(self.rt.generate(call, prompt, params)) as stream:
                async for out in stream:
                    yield out

    @staticmethod
    async def _last(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
        last = first
        async with aclosing(gen) as g:
            async for out in g:
                last = out
        return last

    async def _echo(self, firsts: list[RequestOutput], req: CompletionRequest) -> list[tuple[str, list]]:
        """(prompt text, prompt logprobs) per prompt under `echo`, else ("", [])."""
        if not req.echo:
            return [("", [])] * len(firsts)
        tok, engine = self.rt.core.tokenizer, self.rt.async_engine
        out = []
        for f in firsts:
            text = tok.decode(f.prompt_token_ids) if tok is not None else ""
            lps = []
            if req.logprobs is not None:
                ids, k = f.prompt_token_ids, req.logprobs
                lps = await asyncio.to_thread(engine.snapshot, lambda e, ids=ids, k=k: prompt_logprobs(e, ids, k))
            out.append((text, lps))
        return out

    async def _completion_events(self, head, firsts, gens, params, echoed, usage: bool) -> AsyncIterator[bytes]:
        tok, finals = self.rt.core.tokenizer, list(firsts)
        extra = {"usage": None} if usage else {}
        sent: dict[tuple[int, int], int] = {}  # each choice's token pieces' characters sent: its text_offset base
        try:
            async for p, out in _merge(firsts, gens):
                finals[p] = out
                choices = []
                for c in out.outputs:
                    ids, text, lps = c.delta_token_ids, c.delta_text, R.new_logprobs(c, c.delta_token_ids)
                    if (p, c.index) not in sent:  # the prompt goes out with each choice's first piece
                        sent[p, c.index] = 0
                        if echoed[p][0]:
                            text = echoed[p][0] + text
                            ids, lps = out.prompt_token_ids + ids, echoed[p][1] + lps
                    if not (ids or text or c.finish_reason):
                        continue
                    lp = None
                    if params.logprobs is not None:
                        lp = R.completion_logprobs(tok, ids, lps, sent[p, c.index], k=params.logprobs)
                        sent[p, c.index] += sum(len(s) for s in lp["tokens"])
                    choices.append(
                        {
                            "index": p * params.n + c.index,
                            "text": text,
                            "logprobs": lp,
                            "finish_reason": c.finish_reason,
                        }
                    )
                if choices:
                    yield sse({**head, "choices": choices, **extra})
            if usage:
                yield sse({**head, "choices": [], "usage": R.usage(finals)})
        except Exception as e:  # noqa: BLE001 - headers are out: the error goes in the stream
            yield sse(_error_event(e))
        yield DONE

    async def _chat_events(self, head, first, gen, params, turn: ChatTurn, usage: bool) -> AsyncIterator[bytes]:
        tok, last = self.rt.core.tokenizer, first
        extra = {"usage": None} if usage else {}
        k = params.logprobs
        streams = [turn.stream() for _ in range(params.n)]  # each choice its own parser state
        try:
            roles = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(params.n)
            ]
            yield sse({**head, "choices": roles, **extra})
            async for _, out in _merge([first], [gen]):
                last = out
                choices = []
                for c in out.outputs:
                    if not (c.delta_token_ids or c.delta_text or c.finish_reason):
                        continue
                    delta, finish = streams[c.index].step(c)
                    lp = None
                    if k is not None:
                        lp = R.chat_logprobs(tok, c.delta_token_ids, R.new_logprobs(c, c.delta_token_ids), k)
                    if not (delta or lp is not None or finish):
                        continue  # text a parser holds back (a marker in the making) goes out later
                    choices.append(
                        {"index": c.index, "delta": delta.to_chat(), "logprobs": lp, "finish_reason": finish}
                    )
                if choices:
                    yield sse({**head, "choices": choices, **extra})
            if usage:
                yield sse({**head, "choices": [], "usage": R.usage([last])})
        except Exception as e:  # noqa: BLE001
            yield sse(_error_event(e))
        yield DONE


async def _prime_turn(turn: ChatTurn, gens: list) -> list[RequestOutput]:
    """_prime, with a tool grammar xgrammar refuses named as the tools' fault, not response_format's."""
    try:
        return await _prime(gens)
    except ValueError as e:
        if turn.tool_grammar and str(e).startswith("structured") and not isinstance(e, BadParam):
            raise BadParam(f"tools: {e}", "tools") from None
        raise


def _error_event(e: Exception) -> dict:
    return json.loads(error_response(e).body)
