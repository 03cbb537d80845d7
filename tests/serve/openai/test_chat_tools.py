"""Tool calling and reasoning on /v1/chat/completions, spoken to by the unmodified `openai` client.

One server (Qwen3's real chat template on the random test checkpoint; --tool-call-parser hermes,
--reasoning-parser qwen3, --enable-auto-tool-choice). A random-weight model never chooses to
call a tool, so calls come from tool_choice "required" / a named function (the parser's
structural tag enforces them), or from a regex that writes one under "auto". The independent
references: jsonschema for every call's arguments, transformers' apply_chat_template for the
prompt a tool round trip renders (its token count), the unary answer for the streamed one.
"""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pytest
import transformers
from baton.common.cli import main
from baton.serve.openai.protocol import BadParam
from baton.serve.openai.tool_calling import AgentConfig, Agents
from baton.serve.runtime import Limits

from ..server_fixtures import ServerThread
from .agent_fixtures import TOOL_PARSER, family_ckpts  # noqa: F401 (a fixture)

# bounded schemas: a random model finishes each call within a few dozen tokens
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"flag": {"type": "boolean"}, "tag": {"type": "string", "maxLength": 4}},
            "required": ["flag", "tag"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD, NOTE]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # tools from the first token
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ckpt(family_ckpts):  # noqa: F811 (the fixture)
    return family_ckpts["qwen3"]


@pytest.fixture(scope="module")
def server(ckpt):
    agents = AgentConfig(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")
    # Qwen3's template with three tools renders ~1300 tokens of this byte-level vocabulary
    s = ServerThread(
        ckpt,
        num_kv_blocks=512,
        engine_extra={"max_model_len": 2048},
        http_port=0,
        limits=Limits(max_output_tokens=256, max_n=4),
        agents=agents,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    kw.setdefault("messages", USER)
    kw.setdefault("extra_body", NO_THINKING)
    kw.setdefault("tools", TOOLS)
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model="tiny", temperature=1.0, **kw)


def check_calls(calls, allowed: set[str]) -> None:
    """Each call names an allowed function and its arguments validate against its schema."""
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, **kw) -> dict[int, dict]:
    """A streamed answer put together per choice: content, reasoning, calls (each call's id and
    name must come once, in its first delta) and finish_reason."""
    out: dict[int, dict] = {}
    for chunk in chat(client, stream=True, **kw):
        for ch in chunk.choices:
            c = out.setdefault(ch.index, {"content": "", "reasoning": "", "calls": {}, "finish": None})
            d = ch.delta
            c["content"] += d.content or ""
            c["reasoning"] += getattr(d, "reasoning_content", None) or ""
            for t in d.tool_calls or []:
                if t.index not in c["calls"]:
                    assert t.id and t.function.name, "a call's first delta carries its id and name"
                    c["calls"][t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
                else:
                    assert t.id is None and t.function.name is None, "id and name are sent once"
                c["calls"][t.index]["arguments"] += t.function.arguments or ""
            c["finish"] = ch.finish_reason or c["finish"]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_calls_validate_and_stream_the_same(client, seed):
    kw = dict(tool_choice="required", parallel_tool_calls=False, n=3, seed=seed)
    r = chat(client, **kw)
    assert len(r.choices) == 3
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert len(ch.message.tool_calls) == 1
        check_calls(ch.message.tool_calls, set(SCHEMAS))
    assert_streamed_equal(r, streamed(client, **kw))


def assert_streamed_equal(r, s: dict) -> None:
    """The streamed choices put together equal the unary ones (same seed, same tokens)."""
    for ch in r.choices:
        got = s[ch.index]
        assert (got["finish"], got["content"]) == (ch.finish_reason, ch.message.content or "")
        want = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == want


@pytest.mark.parametrize("seed", [0, 1])
def test_parallel_calls_each_validate(client, seed):
    """parallel_tool_calls (the default): one call or several; a choice that ran out of tokens
    mid-call has its complete calls before the cut."""
    kw = dict(tool_choice="required", n=3, seed=seed)
    r = chat(client, **kw)
    for ch in r.choices:
        assert ch.finish_reason in ("tool_calls", "length")
        calls = ch.message.tool_calls or []
        assert calls or ch.finish_reason == "length"
        check_calls(calls if ch.finish_reason == "tool_calls" else calls[:-1], set(SCHEMAS))
    assert_streamed_equal(r, streamed(client, **kw))


@pytest.mark.parametrize("seed", [3, 4])
def test_a_named_function_is_the_one_call(client, seed):
    kw = dict(tool_choice={"type": "function", "function": {"name": "add"}}, n=2, seed=seed)
    r = chat(client, **kw)
    for ch in r.choices:
        assert len(ch.message.tool_calls) == 1 and ch.finish_reason == "tool_calls"
        check_calls(ch.message.tool_calls, {"add"})
    assert_streamed_equal(r, streamed(client, **kw))


def test_a_tool_round_trip(client, ckpt):
    """call -> the tool's result -> an answer; the second prompt is the template's render of the
    whole conversation (transformers' apply_chat_template, the documented message form)."""
    first = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=5)
    call = first.choices[0].message.tool_calls[0]
    result = '{"temperature": 21}'
    messages = [
        *USER,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    answer = chat(client, messages=messages, tool_choice="auto", seed=6, max_tokens=12)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    documented = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
                }
            ],
        },
        {"role": "tool", "name": "get_weather", "content": result},
    ]
    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    text = hf.apply_chat_template(
        documented, tools=TOOLS, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert result in text and f'"name": "{call.function.name}"' in text
    assert answer.usage.prompt_tokens == len(hf(text, add_special_tokens=False)["input_ids"])


def literal(text: str) -> str:
    """A regex (xgrammar's dialect) matching exactly `text`."""
    return "".join("\\" + ch if ch in "\\^$.|?*+()[]{}" else ch for ch in text)


def _metric(server, name: str, label: str = 'parser="hermes"') -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics").read().decode()
    line = next((ln for ln in body.splitlines() if ln.startswith(name + "{") and label in ln), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


def test_a_tool_set_compiles_once(client, server):
    """The grammar cache's counters for tool sets: a new set is a miss, the same set again a hit."""
    fresh = {"type": "function", "function": {**ADD["function"], "name": "add_once"}}
    kind = 'kind="structural_tag"'
    hits, misses = (
        _metric(server, "baton_grammar_cache_hits_total", kind),
        _metric(server, "baton_grammar_cache_misses_total", kind),
    )
    for _ in range(2):
        chat(client, tools=[fresh], tool_choice="required", max_tokens=1)
    assert _metric(server, "baton_grammar_cache_misses_total", kind) == misses + 1
    assert _metric(server, "baton_grammar_cache_hits_total", kind) == hits + 1
    assert _metric(server, "baton_grammar_compile_seconds_total", kind) > 0


def test_auto_parses_a_call_and_returns_a_broken_one_as_content(client, server):
    """Under "auto" the model's own text is parsed: a regex makes it write a well-formed call, then a
    malformed one, which comes back as content and is counted."""
    calls0, failed0 = _metric(server, "baton_tool_calls_total"), _metric(server, "baton_tool_call_parse_failures_total")
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    r = chat(client, tool_choice="auto", extra_body={**NO_THINKING, "structured_outputs": {"regex": literal(good)}})
    (ch,) = r.choices
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    broken = '<tool_call>\n{"name": add, "arguments": {}}\n</tool_call>'  # not JSON
    r = chat(client, tool_choice="auto", extra_body={**NO_THINKING, "structured_outputs": {"regex": literal(broken)}})
    (ch,) = r.choices
    assert ch.message.tool_calls is None and ch.message.content == broken and ch.finish_reason == "stop"
    s = streamed(
        client, tool_choice="auto", extra_body={**NO_THINKING, "structured_outputs": {"regex": literal(broken)}}
    )
    assert s[0]["content"] == broken and not s[0]["calls"]
    assert _metric(server, "baton_tool_calls_total") == calls0 + 1
    assert _metric(server, "baton_tool_call_parse_failures_total") == failed0 + 2


@pytest.mark.parametrize("seed", [7, 8])
def test_reasoning_is_split_from_json_content_within_the_budget(client, ckpt, seed):
    """qwen3 reasoning parser, a thinking budget and a response_format: the random model thinks
    until the budget forces </think>, then writes JSON. Reasoning never reaches content."""
    budget = 6
    kw = dict(
        messages=USER,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
        seed=seed,
        logprobs=True,
        # ignore_eos: a random model may draw EOS while thinking, which would end it before the budget
        extra_body={"thinking_token_budget": budget, "ignore_eos": True},
    )
    r = client.chat.completions.create(model="tiny", max_tokens=60, **kw)
    (ch,) = r.choices
    msg = ch.message
    jsonschema.validate(json.loads(msg.content), ANSWER)
    assert msg.reasoning_content and "</think>" not in msg.reasoning_content + msg.content
    assert msg.model_extra["reasoning"] == msg.reasoning_content
    # the random model never ends its thinking: the budget forces the end marker right after `budget` tokens
    tokens = [t.token for t in ch.logprobs.content]
    end_ids = transformers.AutoTokenizer.from_pretrained(str(ckpt)).encode("</think>", add_special_tokens=False)
    assert "".join(tokens[:budget]) == msg.reasoning_content
    assert "".join(tokens[budget : budget + len(end_ids)]) == "</think>"
    s = streamed(client, tools=None, **{k: v for k, v in kw.items() if k != "logprobs"})
    assert (s[0]["reasoning"], s[0]["content"]) == (msg.reasoning_content, msg.content)


def _bad_schema(schema: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


BAD = [  # (request fields, the param the 400 names, words in its message)
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "'nope'"),
    (dict(tool_choice="sometimes"), "tool_choice", "tool_choice"),
    (dict(tools=None, tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[]), "tools", "non-empty"),
    (
        dict(tools=_bad_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}})),
        "tools[0].function.parameters",
        "not a valid JSON schema",
    ),
    (dict(tools=_bad_schema({"type": "string"})), "tools[0].function.parameters", "type 'object'"),
    (dict(tools=[{"type": "retrieval"}]), "tools[0].type", "'function'"),
    (dict(tools=[{"type": "function", "function": {"name": "two words"}}]), "tools[0].function.name", "a-z"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", "twice"),
    (
        dict(messages=[*USER, {"role": "tool", "tool_call_id": "call_unknown", "content": "1"}]),
        "messages",
        "call_unknown",
    ),
    (dict(extra_body={"thinking_token_budget": -1}), "thinking_token_budget", ">= 0"),
    (dict(extra_body={"chat_template_kwargs": {"tools": []}}), "chat_template_kwargs", "tools"),
]


@pytest.mark.parametrize("fields, param, words", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_param(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **{"tool_choice": "required", **fields})
    assert e.value.status_code == 400 and e.value.param == param and words in e.value.message


def test_the_server_keeps_serving_after_bad_input(client):
    for fields, _, _ in BAD:  # streamed too: refused before any header
        with pytest.raises(openai.BadRequestError):
            chat(client, stream=True, **{"tool_choice": "required", **fields})
    check_calls(chat(client, tool_choice="required", seed=9).choices[0].message.tool_calls, set(SCHEMAS))


def test_what_the_server_was_not_started_with_is_a_400(server, ckpt):
    """ "auto" needs --enable-auto-tool-choice and a thinking budget a --reasoning-parser (vLLM's
    rules); checked on the server's own engine with other flags."""
    core = server.server.rt.core
    agents = Agents(AgentConfig(), ckpt, core.tokenizer, core.eos_ids)
    assert agents.parser_name == "llama3_json"  # the checkpoint's family (model_type llama) picks it
    with pytest.raises(BadParam, match="--enable-auto-tool-choice") as e:
        agents.turn(USER, tools=TOOLS)  # omitted tool_choice with tools: "auto"
    assert e.value.param == "tool_choice"
    with pytest.raises(BadParam, match="--reasoning-parser") as e:
        agents.turn(USER, thinking_budget=5)
    assert e.value.param == "thinking_token_budget"
    agents.turn(USER, tools=TOOLS, tool_choice="required")  # required needs neither


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--tool-call-parser", "nope"], "unknown --tool-call-parser 'nope'"),
        (["--reasoning-parser", "nope"], "unknown --reasoning-parser 'nope'"),
        (["--chat-template", "/nonexistent.jinja"], "--chat-template '/nonexistent.jinja' cannot be read"),
    ],
)
def test_unknown_parsers_are_refused_at_start(tmp_path, capsys, flags, words):
    assert main(["serve", "--model", str(tmp_path), "--port", "0", "--metrics-port", "-1", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "listening" not in err


def test_a_required_call_follows_the_thinking(client):
    """Thinking on (Qwen3's default): the tool grammar waits for </think>, which the budget forces;
    the reasoning is split off and the call validates, unary and streamed alike."""
    kw = dict(tool_choice="required", parallel_tool_calls=False, n=2, seed=10)
    kw["extra_body"] = {"thinking_token_budget": 4, "ignore_eos": True}
    r = chat(client, **kw)
    for ch in r.choices:
        assert ch.message.reasoning_content and ch.finish_reason == "tool_calls" and ch.message.content is None
        check_calls(ch.message.tool_calls, set(SCHEMAS))
    s = streamed(client, **kw)
    assert [s[ch.index]["reasoning"] for ch in r.choices] == [ch.message.reasoning_content for ch in r.choices]
    assert_streamed_equal(r, s)


def test_vllm_agent_flags_reach_the_config(monkeypatch, tmp_path, ckpt):
    import baton.serve.server as server_module

    seen = []
    monkeypatch.setattr(server_module, "run", lambda config: seen.append(config) or 0)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "deepseek_r1"]
    assert main(["serve", "--model", str(ckpt), *flags, "--chat-template", str(template)]) == 0
    assert seen[0].agents == AgentConfig("qwen3_coder", True, "deepseek_r1", str(template))
    assert main(["serve", "--model", str(ckpt)]) == 0
    assert seen[1].agents == AgentConfig()  # off by default; the parser then comes from the family


@pytest.fixture(scope="module")
def llm(llama_dir):
    """The offline engine on the test weights: every family's turn runs on it (only prompts differ)."""
    from baton.serve.engine import EngineConfig
    from baton.serve.llm import LLM

    return LLM(llama_dir, EngineConfig(num_kv_blocks=1024, block_size=8, max_model_len=4096))


# xgrammar 0.2.9 drops minLength/maxLength from a json_schema format that has `excludes` (its
# documented rule); these two parsers' tags need excludes (a stop marker or a closing tag inside a
# string would end the call early), so a length-bounded string can come out longer than allowed
EXCLUDES_DROP_MAXLENGTH = pytest.mark.xfail(
    strict=True, reason="the parser's structural tag sets `excludes`, under which xgrammar drops maxLength"
)
FAMILY_PARSERS = [
    pytest.param(f, marks=EXCLUDES_DROP_MAXLENGTH) if TOOL_PARSER[f] in ("qwen3_coder", "openai") else f
    for f in TOOL_PARSER
    if TOOL_PARSER[f] and f != "deepseek_r1"  # deepseek_r1 shares deepseek_v3's parser
]


@pytest.mark.parametrize("family", FAMILY_PARSERS)
def test_every_family_enforces_required_and_named_calls(llm, family_ckpts, family):  # noqa: F811 (the fixture)
    """The whole turn for each --tool-call-parser (the family's template, its parser's structural
    tag, the engine, the parser reading the output back): every call of n samples names an allowed
    function and validates against its schema."""
    from baton.serve.sampling_params import SamplingParams

    tok = llm.engine.tokenizer
    agents = Agents(AgentConfig(tool_call_parser=TOOL_PARSER[family]), family_ckpts[family], tok, llm.engine.eos_ids)
    named = {"type": "function", "function": {"name": "note"}}
    for choice, allowed in (("required", set(SCHEMAS)), (named, {"note"})):
        turn = agents.turn(USER, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        ids = turn.render()
        params = SamplingParams(n=4, max_tokens=250, temperature=1.0, seed=0)
        turn.apply(params)
        (out,) = llm.generate(ids, params)
        for c in out.outputs:
            result = turn.parse(c)
            assert result.finish_reason == "tool_calls", (family, c.text)
            (call,) = result.tool_calls
            assert call.name in allowed
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
