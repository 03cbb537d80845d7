"""Real agent clients against a real server: langchain-openai's `bind_tools` and the openai-agents
SDK's chat-completions model each complete a tool round trip (the model calls a tool, the client
runs it and sends the result back, the model answers).

The server is the one a user gets from `baton serve --enable-auto-tool-choice` on a Llama 3.1
checkpoint: no --tool-call-parser, so the family's default (llama3_json, from config.json's
model_type) parses. A random-weight model never chooses a tool, so the first turn asks for one
(tool_choice "required" / a named tool); the follow-up turn runs under the clients' default
("auto"). The independent check: each client's own parsing of what the server sent (its
tool-call objects, its tool arguments validated by the tool's pydantic signature).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import pytest
from baton.serve.openai.tool_calling import AgentConfig
from baton.serve.runtime import Limits
from pydantic import Field

from ..server_fixtures import ServerThread
from .agent_fixtures import family_checkpoint

CITIES = ["Paris", "Tokyo", "Lima"]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    ckpt = family_checkpoint(llama_dir, tmp_path_factory.mktemp("clients") / "llama3_1", "llama3_1")
    s = ServerThread(
        ckpt,
        num_kv_blocks=512,
        engine_extra={"max_model_len": 2048},  # Llama 3.1's template spells every tool out in the prompt
        http_port=0,
        limits=Limits(max_output_tokens=128, max_n=2),
        agents=AgentConfig(enable_auto_tool_choice=True),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base_url(server):
    return f"http://127.0.0.1:{server.server.http_port}/v1"


def test_langchain_bind_tools_round_trip(base_url):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    ran = []

    @tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"], days: Annotated[int, Field(ge=1, le=9)]) -> str:
        """The weather in a city over some days."""
        ran.append((city, days))
        return json.dumps({"city": city, "temperature": 21})

    llm = ChatOpenAI(model="tiny", base_url=base_url, api_key="unused", temperature=1.0, max_tokens=120, max_retries=0)
    human = HumanMessage("What is the weather in Paris?")
    for seed in (0,):
        bound = llm.bind_tools([get_weather], tool_choice="get_weather", seed=seed)  # a named tool
        ai = bound.invoke([human])
        (call,) = ai.tool_calls
        assert ai.response_metadata["finish_reason"] == "tool_calls"
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        jsonschema.validate(call["args"], get_weather.tool_call_schema.model_json_schema())
        # streamed: langchain's chunks add up to the same call (same seed, same tokens)
        chunks = list(bound.stream([human]))
        total = chunks[0]
        for c in chunks[1:]:
            total += c
        assert [(c["name"], c["args"]) for c in total.tool_calls] == [(call["name"], call["args"])]
        result = get_weather.invoke(call)  # a ToolMessage answering the call's id
        answer = llm.bind_tools([get_weather], seed=seed, max_tokens=16).invoke([human, ai, result])  # auto
        assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in ("stop", "length")
    assert [city for city, _ in ran] and all(city in CITIES for city, _ in ran)


def test_openai_agents_chat_completions_model_round_trip(base_url):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.items import ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    ran = []

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"{city}: 21 degrees, clear"

    model = OpenAIChatCompletionsModel(model="tiny", openai_client=AsyncOpenAI(base_url=base_url, api_key="unused"))
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=model,
        # "required" for the first turn; the SDK resets it to auto once the tool has run (reset_tool_choice)
        # parallel_tool_calls=False: Llama 3.1's template takes one call per assistant turn
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=1.0, extra_args={"seed": 3}
        ),
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    calls = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert calls and len(outputs) == len(calls) == len(ran) and all(city in CITIES for city in ran)
    assert outputs[0].output == f"{ran[0]}: 21 degrees, clear"
    assert isinstance(result.final_output, str)
