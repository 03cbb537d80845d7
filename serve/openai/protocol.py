"""OpenAI's request/response shapes (pydantic), their mapping onto SamplingParams, SSE framing, errors.

Requests are parsed with pydantic (strict ints and bools: "5" or true is not an integer) and then
mapped onto serve/sampling_params.SamplingParams, whose validate() names the bad field; the HTTP
layer turns that name into the error's `param`. vLLM's extra sampling fields (top_k, min_p, ...)
are accepted as vLLM accepts them.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from baton.serve.core.structured import StructuredOutputs
from baton.serve.sampling_params import SamplingParams
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

Number = Annotated[float, Field(strict=True)]  # strict float still takes ints, never strings
DONE = b"data: [DONE]\n\n"
# status -> (OpenAI error type, code)
ERROR_KINDS = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "server_full"),
    500: ("server_error", "internal_error"),
    503: ("service_unavailable", "service_unavailable"),
}


def sse(obj: dict) -> bytes:
    """One server-sent event: `data: <compact JSON>` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind, code = ERROR_KINDS.get(status, ERROR_KINDS[500])
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class JsonSchemaSpec(BaseModel):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict | StrictBool = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class SamplingRequest(BaseModel):
    """The fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")  # e.g. `user`, `metadata`: accepted and ignored, as vLLM does
    model: StrictStr = ""
    n: StrictInt = 1
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: StrictInt = 0
    min_p: Number = 0.0
    repetition_penalty: Number = 1.0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    structured_outputs: dict | None = None  # vLLM's {"json" | "regex" | "grammar" | "json_object": ...}


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    # tool calling and reasoning: checked by serve/openai/tool_calling.ChatTurn, which names the bad param
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None  # omitted: "auto" with tools, else "none" (OpenAI's defaults)
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: passed to the chat template (enable_thinking, ...)
    thinking_token_budget: StrictInt | None = None  # vLLM's name: reasoning tokens before </think> is forced


class BadParam(ValueError):
    """A bad request parameter; `param` is its OpenAI name."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


_FIELD = re.compile(r"^(?:structured\.)?([a-z_]+)")


def param_of(message: str, names: set[str]) -> str | None:
    """The request field a SamplingParams message starts with, if the request has one by that name."""
    m = _FIELD.match(message)
    if m is None:
        return None
    name = m[1]
    if message.startswith("structured"):
        return "response_format"
    return name if name in names else None


def structured_of(req: SamplingRequest) -> StructuredOutputs | None:
    if req.structured_outputs is not None and req.response_format is not None:
        raise BadParam("give response_format or structured_outputs, not both", "response_format")
    if req.structured_outputs is not None:
        try:
            return StructuredOutputs(**req.structured_outputs)
        except TypeError:
            keys = sorted(req.structured_outputs)
            raise BadParam(
                f"structured_outputs takes json, json_object, regex, grammar or structural_tag; got {keys}", "structured_outputs"
            ) from None
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputs(json_object=True)
    if rf.json_schema is None:
        raise BadParam("response_format of type json_schema needs a json_schema", "response_format")
    return StructuredOutputs(json=rf.json_schema.schema_)


def sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine's parameters for this request, validated (BadParam names the field)."""
    if req.logit_bias:
        raise BadParam("logit_bias is not supported by this server", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise BadParam("stream_options is only allowed with stream: true", "stream_options")
    params = SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=[] if req.stop is None else req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        structured=structured_of(req),
    )
    try:
        params.validate()
    except ValueError as e:
        raise BadParam(str(e), param_of(str(e), set(type(req).model_fields))) from None
    return params
