"""/v1/responses, spoken to by the unmodified `openai` client and the `openai-agents` SDK.

One server: Qwen3's real chat template on the random test checkpoint (--tool-call-parser hermes,
--reasoning-parser qwen3, --enable-auto-tool-choice), as the chat tests run. A random-weight
model never chooses to call a tool, so calls come from tool_choice "required" / a named function.
Independent references: transformers' apply_chat_template on the conversation in its documented
message form (its token count must be the response's input_tokens, whether the conversation came
by previous_response_id or as a full replay with store=false), jsonschema for every call's
arguments, and the openai client's own stream accumulator (`responses.stream`, which checks event
order and item identities) for the events.
"""

from __future__ import annotations

import json
from typing import Literal

import agents
import jsonschema
import openai
import pydantic
import pytest
import transformers
from baton.serve.openai.responses_api import ResponsesRoute
from baton.serve.openai.tool_calling import AgentConfig
from baton.serve.runtime import Limits

from ..server_fixtures import ServerThread
from .agent_fixtures import family_checkpoint

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather.", "parameters": WEATHER_PARAMS}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}  # chat's shape
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
JSON_ANSWER = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}  # ends the random model's text
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # calls and text from the first token
NAMED = {"type": "function", "name": "get_weather"}
RESULT = '{"temperature": 21}'


@pytest.fixture(scope="module")
def ckpt(llama_dir, tmp_path_factory):
    return family_checkpoint(llama_dir, tmp_path_factory.mktemp("responses") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def server(ckpt):
    config = AgentConfig(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    s = ServerThread(
        ckpt,
        num_kv_blocks=512,
        engine_extra={"max_model_len": 2048},
        http_port=0,
        limits=Limits(max_output_tokens=256),
        agents=config,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def url(server):
    return f"http://127.0.0.1:{server.server.http_port}/v1"


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(ckpt):
    return transformers.AutoTokenizer.from_pretrained(str(ckpt))


def prompt_tokens(hf, messages: list[dict], tools: list[dict] | None = None, **kw) -> int:
    """The reference: the template's render of the conversation in chat's documented form, tokenized."""
    text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kw)
    return len(hf(text, add_special_tokens=False)["input_ids"])


def _args(kw: dict) -> dict:
    """The request: no thinking unless extra_body says otherwise; `seed` (vLLM's extra) in extra_body."""
    kw = {"model": "tiny", "temperature": 1.0, "max_output_tokens": 200, "extra_body": NO_THINKING, **kw}
    if "seed" in kw:
        kw["extra_body"] = {**kw["extra_body"], "seed": kw.pop("seed")}
    return kw


def create(client, **kw):
    return client.responses.create(**_args(kw))


def streamed(client, **kw):
    """The final response as the openai client's stream accumulator builds it, and the raw events."""
    with client.responses.stream(**_args(kw)) as s:
        events = list(s)
        return s.get_final_response(), events


def documented_call(call) -> dict:
    """A function_call item as transformers documents an assistant's call (arguments as a dict)."""
    return {"type": "function", "function": {"name": call.name, "arguments": json.loads(call.arguments)}}


def check_sequence(events) -> None:
    """sequence_number counts from 0; created and in_progress open, completed closes; every item
    is added before its pieces and done after them."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    open_items: set[int] = set()
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            open_items.add(e.output_index)
        elif e.type == "response.output_item.done":
            open_items.remove(e.output_index)
        else:
            assert e.output_index in open_items, e.type
    assert not open_items


def test_text_unary_and_streamed(client, hf):
    kw = dict(input="Is the sky blue?", instructions="Answer in JSON.", text=JSON_ANSWER, seed=1)
    r = create(client, **kw)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    jsonschema.validate(json.loads(r.output_text), ANSWER)
    messages = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Is the sky blue?"}]
    assert r.usage.input_tokens == prompt_tokens(hf, messages, enable_thinking=False)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    final, events = streamed(client, **kw)
    check_sequence(events)
    assert final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert "".join(deltas) == done.text == r.output_text
    # cut by max_output_tokens: incomplete, as OpenAI reports it
    cut = create(client, input="Hello", max_output_tokens=3, seed=2)
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert cut.usage.output_tokens == 3 and cut.output[-1].status == "incomplete"
    raw = list(create(client, input="Hello", max_output_tokens=3, seed=2, stream=True))
    assert raw[-1].type == "response.incomplete" and raw[-1].response.output_text == cut.output_text


def test_function_call_round_trip_with_previous_response_id(client, hf):
    first = create(client, input="Weather in Paris?", tools=[WEATHER], tool_choice=NAMED, seed=3)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.status == "completed" and call.id.startswith("fc_") and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    second = create(
        client, input=[output], previous_response_id=first.id, tools=[WEATHER], tool_choice="none", max_output_tokens=4
    )
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    documented = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [documented_call(call)]},
        {"role": "tool", "name": "get_weather", "content": RESULT},
    ]
    want = prompt_tokens(hf, documented, [CHAT_WEATHER], enable_thinking=False)
    assert second.usage.input_tokens == want
    # the same conversation replayed in full with store=false: the same prompt, and nothing stored
    replay = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True), output]
    third = create(client, input=replay, tools=[WEATHER], tool_choice="none", max_output_tokens=4, store=False)
    assert third.usage.input_tokens == want
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)
    with pytest.raises(openai.BadRequestError) as e:
        create(client, input="Next?", previous_response_id=third.id)
    assert (e.value.body["param"], e.value.body["code"]) == ("previous_response_id", "previous_response_not_found")
    # stored ones can be read back and deleted
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


@pytest.mark.parametrize("seed", [4, 5])
def test_streamed_calls_equal_the_unary_ones(client, seed):
    kw = dict(input="Weather?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, seed=seed)
    r = create(client, **kw)
    final, events = streamed(client, **kw)
    check_sequence(events)
    want = [(i.name, i.arguments) for i in r.output if i.type == "function_call"]
    assert want and [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == want
    for name, arguments in want:
        jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [(i.name, i.arguments, i.status) for i in added] == [(n, "", "in_progress") for n, _ in want]
    for item in final.output:  # each call's argument deltas add up to its done event's and its item's
        deltas = [e.delta for e in events if e.type.endswith("arguments.delta") and e.item_id == item.id]
        (done,) = [e for e in events if e.type.endswith("arguments.done") and e.item_id == item.id]
        assert "".join(deltas) == done.arguments == item.arguments


def test_reasoning_items(client, hf):
    """--reasoning-parser qwen3 and a thinking budget: the random model thinks until </think> is
    forced, then makes the call. The reasoning is its own item, before the call, streamed as
    reasoning_text deltas; replayed as input it is rendered as the template renders reasoning_content."""
    budget = 5
    kw = dict(input="Weather?", tools=[WEATHER], tool_choice=NAMED, seed=11)
    kw["extra_body"] = {"thinking_token_budget": budget}
    r = create(client, **kw)
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and call.type == "function_call"
    text = reasoning.content[0].text
    assert text and "</think>" not in text and reasoning.content[0].type == "reasoning_text"
    end = len(hf.encode("</think>", add_special_tokens=False))
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= budget + end
    final, events = streamed(client, **kw)
    check_sequence(events)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
    assert [i.type for i in final.output] == ["reasoning", "function_call"] and final.output[0].content[0].text == text
    # replayed in full: the reasoning rides on the call's assistant message (Qwen3 renders it in a tool loop)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    replay = [{"role": "user", "content": "Weather?"}, *(i.model_dump(exclude_none=True) for i in r.output), output]
    again = create(client, input=replay, tools=[WEATHER], tool_choice="none", max_output_tokens=2, store=False)
    documented = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": text, "tool_calls": [documented_call(call)]},
        {"role": "tool", "name": call.name, "content": RESULT},
    ]
    assert again.usage.input_tokens == prompt_tokens(hf, documented, [CHAT_WEATHER], enable_thinking=False)


def test_the_store_keeps_the_last_responses(client, server):
    """LRU: with room for two, the oldest id is forgotten; reading one makes it the most recent."""
    app = server.server._http._server.config.app
    (route,) = {getattr(r.endpoint, "__self__", None) for r in app.routes if r.path == "/v1/responses"}
    assert isinstance(route, ResponsesRoute)
    limit, route.limit = route.limit, 2
    try:
        ids = [create(client, input="Hi", max_output_tokens=1).id for _ in range(2)]
        client.responses.retrieve(ids[0])  # now the most recent
        newest = create(client, input="Hi", max_output_tokens=1, previous_response_id=ids[0]).id
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[1])
        assert [client.responses.retrieve(i).id for i in (ids[0], newest)] == [ids[0], newest]
    finally:
        route.limit = limit


class Answer(pydantic.BaseModel):
    """The agent's final output: the SDK asks for it as a JSON schema, which also ends the random
    model's answer (an answer cut by max_tokens is an error to the SDK)."""

    ok: bool


class Weather:
    """The agent's tool: records every call the SDK makes to it."""

    def __init__(self):
        self.calls: list[dict] = []

        @agents.function_tool
        def get_weather(city: Literal["Paris", "Tokyo", "Lima"], unit: Literal["celsius", "fahrenheit"]) -> str:
            """The weather in a city."""
            self.calls.append({"city": city, "unit": unit})
            return RESULT

        self.tool = get_weather


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk_runs_a_tool(url, api):
    """An Agent with a function tool, over the SDK's Responses model (its default) and its chat
    completions model: the first turn must call (tool_choice required; the SDK then resets it to
    auto), the tool really runs with arguments valid for its schema, and the run finishes with the
    agent's output type."""
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    model_cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    weather = Weather()
    # one call per turn: a random model's call is ~130 tokens of this byte-level vocabulary
    settings = agents.ModelSettings(
        tool_choice="required", parallel_tool_calls=False, max_tokens=200, extra_body={**NO_THINKING, "seed": 0}
    )
    model = model_cls("tiny", client)
    agent = agents.Agent(name="weather", tools=[weather.tool], model=model, model_settings=settings, output_type=Answer)
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=4)
    assert weather.calls, "the tool ran"
    for args in weather.calls:
        jsonschema.validate(args, weather.tool.params_json_schema)
    assert isinstance(result.final_output, Answer) and len(result.raw_responses) >= 2


BAD = [  # (request fields, the param the 400 names, words in its message)
    (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}), "tool_choice", "'nope'"),
    (dict(tool_choice={"type": "allowed_tools", "tools": []}), "tool_choice", "allowed_tools"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type", "web_search"),
    (dict(tools=[{**WEATHER, "parameters": {"type": "nonsense"}}]), "tools[0].parameters", "tools[0].parameters"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type", "item_reference"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image"}]}]), "input[0].content[0]", "input_image"),
    (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}]), "input[0].call_id", "call_x"),
    (dict(input=[{"type": "reasoning", "encrypted_content": "gA"}]), "input[0].encrypted_content", "encrypted"),
    (dict(input=5), "input", "input"),
    (dict(input=[]), "input", "empty"),
    (dict(max_output_tokens=0), "max_output_tokens", "max_output_tokens"),
    (dict(temperature="hot"), "temperature", "temperature"),
    (dict(text={"format": {"type": "json_schema", "name": "a"}}), "text.format.schema", "schema"),
    (dict(background=True), "background", "background"),
    (dict(truncation="auto"), "truncation", "truncation"),
    (dict(previous_response_id="resp_nope"), "previous_response_id", "resp_nope"),
]


@pytest.mark.parametrize("fields,param,words", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_a_400_naming_the_param(client, fields, param, words):
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.body["param"] == param and words in e.value.body["message"]


def test_the_server_keeps_serving_after_bad_input(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_unknown")
    assert create(client, input="Hi", max_output_tokens=2).usage.output_tokens == 2
