"""/v1/responses: OpenAI's Responses API over the chat pipeline (serve/openai/tool_calling.ChatTurn).

A request becomes one chat turn (input items -> chat messages, flat `function` tools -> chat tools),
so prompt, tool grammar and reasoning split are exactly chat's. The answer is output items
(reasoning, message, function_call, in the order the model produced them), streamed as OpenAI's
typed events (response.created ... response.completed, each with a sequence_number).

Input items -> messages (vLLM's mapping): `instructions` -> a system message (not carried over by
previous_response_id, as OpenAI says); a message item -> its role's message (chat maps developer
onto system where the template has no developer role); a reasoning item opens an assistant message
(`reasoning_content`) that an assistant message and function_calls join; function_call_output -> tool.

`previous_response_id` reads a bounded in-memory store: the last MAX_STORED (1000) responses, least
recently used dropped first; `store: false` keeps one out. A stored response holds only its own
turn's messages and its parent, so a chain of N turns costs O(N), and a descendant keeps an evicted
ancestor's turn alive. Nothing survives a restart: replay the full input with `store: false` then.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal

from baton.serve.openai import protocol
from baton.serve.openai.protocol import BadParam, Number, SamplingRequest
from baton.serve.openai.tool_calling import ChatTurn, TurnDelta
from baton.serve.openai.tool_parsers.base import ToolCallDelta
from baton.serve.outputs import RequestOutput
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_STORED = 1000  # responses kept for previous_response_id / GET (least recently used dropped first)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# chat's names for the params a Responses request spells differently (errors name the caller's param)
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
ECHOED = ("instructions", "max_output_tokens", "parallel_tool_calls", "previous_response_id", "store", "temperature")
ECHOED += ("top_p", "user")
OUTPUT_TEXT = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
# item type -> (id prefix, its fields, its content part, its text events' prefix)
TEXT_ITEMS = {
    "reasoning": ("rs", {"summary": []}, {"type": "reasoning_text", "text": ""}, "response.reasoning_text"),
    "message": ("msg", {"role": "assistant"}, OUTPUT_TEXT, "response.output_text"),
}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
SAMPLING += ("seed",)
TEXT_PARTS = ("input_text", "output_text", "refusal", "reasoning_text", "summary_text")
# OpenAI params this server refuses unless at their defaults (it never drops input, as truncation "auto" would)
UNSUPPORTED = {"background": (None, False), "truncation": (None, "disabled"), "top_logprobs": (None, 0)}
UNSUPPORTED["conversation"] = (None,)
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    def chat(self) -> protocol.ResponseFormat:
        """Chat's response_format for this text.format."""
        if self.type != "json_schema":
            return protocol.ResponseFormat(type=self.type)
        if self.schema_ is None:
            raise BadParam("text.format.schema: a json_schema format needs a schema", "text.format.schema")
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict}
        return protocol.ResponseFormat(type="json_schema", json_schema=protocol.JsonSchemaSpec.model_validate(spec))


class TextConfig(BaseModel):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """OpenAI's create-response body (the fields an open model can honour); unknown fields are
    ignored, as vLLM does. The sampling extras are vLLM's, plus chat's Baton extras."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr = ""
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    # refused unless at their defaults (UNSUPPORTED)
    background: StrictBool | None = None
    truncation: StrictStr | None = None
    top_logprobs: StrictInt | None = None
    conversation: Any = None
    # vLLM's sampling extras; Baton's chat extras
    top_k: StrictInt = 0
    min_p: Number = 0.0
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    seed: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: StrictInt | None = None


# ---------------------------------------------------------------------------------- input -> chat
def _bad(param: str, why: str) -> BadParam:
    return BadParam(f"{param}: {why}", param)


def _part_text(content, where: str) -> str:
    """A message's content: a string or a list of text parts (reasoning items' parts too)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in TEXT_PARTS or not isinstance(part.get(key), str):
            raise _bad(f"{where}[{j}]", f"content type {kind!r} is not supported (text only: {', '.join(TEXT_PARTS)})")
        out.append(part[key])
    return "".join(out)


def _field(item: dict, key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise _bad(f"{where}.{key}", "must be a string")
    return item[key]


def input_messages(items: str | list, known_calls: set[str]) -> list[dict]:
    """Chat messages for Responses input items (or output items: they are valid input). `known_calls`
    (extended in place): the call ids made so far, which a function_call_output must answer."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []

    def assistant(new: bool) -> dict:
        if new or not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role", f"must be user, assistant, system or developer; got {role!r}")
            text = _part_text(item.get("content"), f"{where}.content")
            if role == "assistant":  # joins the reasoning item just before it, if any
                prev = out[-1] if out else {}
                assistant(prev.get("role") != "assistant" or prev["content"] or "tool_calls" in prev)["content"] = text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name, args = (_field(item, k, where) for k in ("call_id", "name", "arguments"))
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            assistant(False).setdefault("tool_calls", []).append(call)
            known_calls.add(call_id)
        elif kind == "function_call_output":
            call_id, output = _field(item, "call_id", where), item.get("output")
            if call_id not in known_calls:
                raise _bad(f"{where}.call_id", f"{call_id!r} answers no function_call in this conversation")
            text = output if isinstance(output, str) else _part_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise _bad(f"{where}.encrypted_content", "encrypted reasoning is not supported by this server")
            text = _part_text(item.get("content") or item.get("summary") or [], f"{where}.content")
            assistant(True)["reasoning_content"] = text
        else:
            raise _bad(f"{where}.type", f"item type {kind!r} is not supported ({', '.join(ITEM_TYPES)})")
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools -> chat's {"type": "function", "function": {...}} (ChatTurn
    then checks names and schemas)."""
    for j, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise _bad(f"tools[{j}].type", f"{tool.get('type')!r} is not supported (function tools only)")
    fns = [{k: t[k] for k in ("name", "description", "parameters", "strict") if k in t} for t in tools or []]
    return None if tools is None else [{"type": "function", "function": fn} for fn in fns]


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            why = 'use "none", "auto", "required" or {"type": "function", "name": ...}'
            raise BadParam(f"tool_choice of type {choice.get('type')!r} is not supported: {why}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


# ---------------------------------------------------------------------------------- output items
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Output:
    """A response's output items, built from a turn's pieces in the order they come, and the stream
    events that build them (unary answers build the same items and drop the events)."""

    def __init__(self):
        self.items: list[dict] = []
        self.events: list[dict] = []  # not yet sent
        self.seq = 0
        self._open: dict | None = None  # the item receiving pieces
        self._text = ""  # the open reasoning or message item's text so far
        self._calls: dict[int, dict] = {}  # the parser's call index -> its item
        self._index: dict[str, int] = {}  # item id -> output_index

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        self.events.append(e)
        return e

    def flush(self) -> bytes:
        """The events so far as server-sent events (OpenAI's framing: `event:` names the type)."""
        text = "".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in self.events)
        self.events.clear()
        return text.encode()

    def _at(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self._index[item["id"]]}

    def _start(self, item: dict, part: dict | None = None) -> None:
        self.close()
        self._index[item["id"]] = len(self.items)
        self.items.append(item)
        self._open, self._text = item, ""
        self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))
        if part is not None:
            self.event("response.content_part.added", **self._at(item), content_index=0, part=part)

    def _piece(self, kind: str, delta: str) -> None:
        """Text for the open reasoning or message item (a new item if another kind is open)."""
        if not delta:
            return
        prefix, extra, part, events = TEXT_ITEMS[kind]
        if self._open is None or self._open["type"] != kind:
            self._start({"id": _id(prefix), "type": kind, **extra, "status": "in_progress", "content": []}, part)
        self._text += delta
        logprobs = {"logprobs": []} if kind == "message" else {}
        self.event(f"{events}.delta", **self._at(self._open), content_index=0, delta=delta, **logprobs)

    def add(self, d: TurnDelta) -> None:
        self._piece("reasoning", d.reasoning)
        self._piece("message", d.content)
        for c in d.tool_calls:
            if c.id is not None:  # a call's first piece: its id and name
                item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": c.id}
                self._start({**item, "name": c.name or "", "arguments": ""})
                self._calls[c.index] = self._open
            item = self._calls.get(c.index)
            if item is not None and c.arguments:
                item["arguments"] += c.arguments
                self.event("response.function_call_arguments.delta", **self._at(item), delta=c.arguments)

    def close(self, status: str = "completed") -> None:
        """Finish the open item: its done events, and its final shape in `items` ("incomplete": the
        output was cut inside it)."""
        item, self._open = self._open, None
        if item is None:
            return
        at = self._at(item)
        item["status"] = status
        if item["type"] == "function_call":
            self.event("response.function_call_arguments.done", **at, arguments=item["arguments"])
        else:
            _, _, part, events = TEXT_ITEMS[item["type"]]
            item["content"] = [part := dict(part, text=self._text)]
            logprobs = {"logprobs": []} if item["type"] == "message" else {}
            self.event(f"{events}.done", **at, content_index=0, text=self._text, **logprobs)
            self.event("response.content_part.done", **at, content_index=0, part=part)
        self.event("response.output_item.done", output_index=at["output_index"], item=item)


def usage(out: RequestOutput, turn: ChatTurn, reasoning: str | None) -> dict:
    """Token counts; the reasoning tokens are those up to and including the end-of-thinking marker
    (all of them if thinking never ended)."""
    ids, end = out.outputs[0].token_ids, turn.agents.think_end_ids
    starts = range(len(ids) - len(end) + 1 if reasoning and end else 0)
    thought = next((k + len(end) for k in starts if ids[k : k + len(end)] == end), len(ids)) if reasoning else 0
    prompt, cached = len(out.prompt_token_ids), {"cached_tokens": out.metrics.num_cached_prompt_tokens}
    made = {"output_tokens": len(ids), "output_tokens_details": {"reasoning_tokens": thought}}
    details = {"input_tokens_details": cached | {"cache_write_tokens": 0}}
    return {"input_tokens": prompt, **details, **made, "total_tokens": prompt + len(ids)}


# ---------------------------------------------------------------------------------- the store
@dataclass(frozen=True)
class Stored:
    """A stored response: its body (what GET returns), its turn as chat messages (input, then output),
    the call ids made up to it, and the turn it continued."""

    body: dict
    messages: tuple[dict, ...]
    calls: frozenset[str]
    parent: Stored | None

    def history(self) -> list[dict]:
        turns, node = [], self
        while node is not None:
            turns.append(node.messages)
            node = node.parent
        return [m for t in reversed(turns) for m in t]


def _error(status: int, message: str, param: str | None, code: str | None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _missing(rid: str) -> JSONResponse:
    return _error(404, f"No response found with id '{rid}'.", "response_id", "not_found")


# ---------------------------------------------------------------------------------- the route
class ResponsesRoute:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}, on an OpenAIFront (its runtime, its
    shared chat `agents`, its accounted `_generate`). `errors` is the front's exception -> OpenAI
    error JSON mapping, handed in so this module need not import the app that imports it."""

    def __init__(self, front, errors: Callable[[Exception, set[str]], JSONResponse], limit: int = MAX_STORED):
        self.front, self.errors, self.limit = front, errors, limit
        self.store: OrderedDict[str, Stored] = OrderedDict()  # least recently used first

    def stored(self, rid: str) -> Stored | None:
        if rid in self.store:
            self.store.move_to_end(rid)
        return self.store.get(rid)

    def register(self, app: FastAPI) -> None:
        app.post("/v1/responses")(self.create)
        app.get("/v1/responses/{response_id}")(self.retrieve)
        app.delete("/v1/responses/{response_id}")(self.delete)

    async def retrieve(self, response_id: str) -> JSONResponse:
        hit = self.stored(response_id)
        return _missing(response_id) if hit is None else JSONResponse(hit.body)

    async def delete(self, response_id: str) -> JSONResponse:
        if self.store.pop(response_id, None) is None:
            return _missing(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def _turn(self, req: ResponsesRequest, parent: Stored | None) -> tuple[ChatTurn, list[dict], set[str]]:
        """The chat turn for a request continuing `parent`, its own new messages, and the call ids
        made so far."""
        self.front.rt.check_model(req.model)
        for name, fine in UNSUPPORTED.items():
            if getattr(req, name) not in fine:
                raise BadParam(f"{name} {getattr(req, name)!r} is not supported by this server", name)
        calls = set(parent.calls) if parent is not None else set()
        new = input_messages(req.input, calls)
        if not new:
            raise _bad("input", "is empty")
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning and req.reasoning.get("effort") is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning["effort"])  # gpt-oss's template reads it
        turn = self.front.agents.turn(
            system + (parent.history() if parent else []) + new,
            tools=chat_tools(req.tools),
            tool_choice=chat_tool_choice(req.tool_choice),
            parallel_tool_calls=req.parallel_tool_calls,
            chat_template_kwargs=kwargs or None,
            thinking_budget=req.thinking_token_budget,
        )
        return turn, new, calls

    def _params(self, req: ResponsesRequest, n_prompt: int):
        rt = self.front.rt
        max_tokens = req.max_output_tokens
        if max_tokens is None:  # OpenAI's default: what the context leaves
            max_tokens = max(1, min(rt.limits.max_output_tokens, rt.core.max_model_len - n_prompt))
        fmt = req.text.format if req.text is not None else None
        shared = {k: getattr(req, k) for k in SAMPLING}
        sreq = SamplingRequest.model_construct(**shared, response_format=fmt and fmt.chat())
        return protocol.sampling_params(sreq, max_tokens, None)

    async def create(self, req: ResponsesRequest, http: Request) -> Response:
        fields, prev = set(ResponsesRequest.model_fields), req.previous_response_id
        parent = None if prev is None else self.stored(prev)
        if prev is not None and parent is None:
            why = f"Previous response with id '{prev}' not found."
            return _error(400, why, "previous_response_id", "previous_response_not_found")  # OpenAI's answer
        try:
            turn, new, calls = self._turn(req, parent)
            ids = await asyncio.to_thread(turn.render)
            params = self._params(req, len(ids))
            turn.apply(params)
            gen = self.front._generate("openai/v1/responses", ids, params, http)
            try:
                first = await anext(gen)
            except BaseException as e:
                await gen.aclose()
                tag = params.structured is not None and params.structured.structural_tag is not None
                if tag and isinstance(e, ValueError) and str(e).startswith("structured"):
                    raise BadParam(f"tools: {e}", "tools") from None  # xgrammar refused the tools' grammar
                raise
            rid, created = _id("resp"), int(time.time())
            body = self._body(rid, created, req)
            if req.stream:
                events = self._events(body, req, turn, (parent, new, calls), first, gen)
                return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
            last = await self.front._last(first, gen)
            result = turn.parse(last.outputs[0])
            out = Output()
            out.add(TurnDelta(result.reasoning or "", result.content))
            for i, c in enumerate(result.tool_calls):  # one call at a time: each its own item, as streamed
                out.add(TurnDelta(tool_calls=[ToolCallDelta(i, c.id, c.name, c.arguments)]))
            out.close(_status(last))
            final = self._finish(body, req, (parent, new, calls), out.items, last, turn, result.reasoning)
        except Exception as e:  # noqa: BLE001 - every failure becomes OpenAI's error JSON
            return self._error_response(e, fields)
        return JSONResponse(final)

    def _error_response(self, e: Exception, fields: set[str]) -> JSONResponse:
        """The front's error JSON, its `param` renamed to this API's (messages -> input, ...)."""
        resp = self.errors(e, fields)
        err = (body := json.loads(resp.body))["error"]
        param = err.get("param") or ""
        if param not in PARAMS and not param.startswith("tools["):
            return resp
        err["param"] = PARAMS.get(param) or param.replace(".function", "")  # Responses' tools are flat
        if param.startswith("tools[") or not err["message"].startswith(param + "["):  # messages[i] are chat's
            err["message"] = err["message"].replace(param, err["param"], 1)
        return JSONResponse(body, status_code=resp.status_code)

    def _body(self, rid: str, created: int, req: ResponsesRequest) -> dict:
        """The response object before its output: the request's settings echoed, as OpenAI does."""
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {"format": {"type": "text"}}
        body = {"id": rid, "object": "response", "created_at": created, "status": "in_progress", "error": None}
        body |= {"incomplete_details": None, "model": self.front.rt.model_name, "output": [], "usage": None}
        body |= {k: getattr(req, k) for k in ECHOED} | {"metadata": req.metadata or {}, "tools": req.tools or []}
        body |= {"tool_choice": req.tool_choice or "auto", "reasoning": req.reasoning or {"effort": None}}
        return body | {"text": text, "background": False, "truncation": "disabled"}

    def _finish(self, body, req, convo, items, last: RequestOutput, turn: ChatTurn, reasoning) -> dict:
        """The completed (or, cut by max_output_tokens, incomplete) response; stored unless store=false.
        `convo`: (the conversation it continues, this request's messages, the call ids so far)."""
        final = dict(body, output=items, usage=usage(last, turn, reasoning))
        final["status"] = _status(last)
        if final["status"] == "incomplete":
            final["incomplete_details"] = {"reason": "max_output_tokens"}
        if req.store:
            parent, new, calls = convo
            messages = new + input_messages(items, calls)
            self.store[final["id"]] = Stored(final, tuple(messages), frozenset(calls), parent)
            while len(self.store) > self.limit:
                self.store.popitem(last=False)
        return final

    async def _events(self, body, req, turn: ChatTurn, convo, first, gen) -> AsyncIterator[bytes]:
        out, last, o = Output(), first, first
        out.event("response.created", response=body)
        out.event("response.in_progress", response=body)
        yield out.flush()
        stream, reasoning = turn.stream(), ""
        try:
            async with aclosing(gen) as g:
                while o is not None:  # the first output, then the rest
                    last, (delta, _) = o, stream.step(o.outputs[0])
                    reasoning += delta.reasoning
                    out.add(delta)
                    if out.events:
                        yield out.flush()
                    o = None if o.finished else await anext(g, None)
            out.close(_status(last))
            final = self._finish(body, req, convo, out.items, last, turn, reasoning or None)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            out.event(kind, response=final)
        except Exception as e:  # noqa: BLE001 - headers are out: the error goes in the stream
            err = json.loads(self._error_response(e, set()).body)["error"]
            out.event("error", code=err["code"], message=err["message"], param=err["param"])
            failed = dict(body, status="failed", error={"code": "server_error", "message": err["message"]})
            out.event("response.failed", response=failed)
        yield out.flush()


def _status(last: RequestOutput) -> str:
    return "incomplete" if last.outputs[0].finish_reason == "length" else "completed"
