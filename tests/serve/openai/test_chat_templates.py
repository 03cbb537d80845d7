"""Chat templates render what agents send: tools, assistant tool calls, tool results, reasoning,
chat_template_kwargs, --chat-template; gpt-oss's harmony conversations.

The independent check of our OpenAI -> template message mapping (serve/openai/chat.py): each
family's template (templates/*.jinja, Baton's own in the family's documented format) renders our
mapping of an OpenAI conversation exactly as transformers' apply_chat_template renders the same
conversation written the way that template expects it (arguments a dict or text, reasoning as
`thinking`, transformers' tool-use docs' shape otherwise); and each render shows the call and the
result, so a mapping that silently dropped them could not pass. gpt-oss's: our render equals
openai-harmony's rendering of the same conversation written by hand as harmony messages, from
OpenAI's harmony guide.
"""

from __future__ import annotations

import copy
import datetime
import inspect
import json

import pytest
import transformers
from baton.serve.openai.chat import RESERVED_KWARGS, ChatTemplate, NoChatTemplate, chat_template, normalize
from baton.serve.openai.harmony_vocab import harmony_encoding
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from .agent_fixtures import (
    CALL_ARGUMENTS,
    CALL_ID,
    TEMPLATE_FAMILIES,
    TOOL_RESULT,
    TOOLS,
    family_ckpts,  # noqa: F401 - a fixture these tests use
    tool_conversation,
)

ARGS = json.loads(CALL_ARGUMENTS)


@pytest.fixture(scope="module")
def ckpts(family_ckpts):  # noqa: F811 - the fixture imported above
    """family -> (a checkpoint with the family's template, its tokenizer as transformers loads it);
    gpt_oss -> (its checkpoint, None)."""
    return {
        family: (ckpt, transformers.AutoTokenizer.from_pretrained(str(ckpt)) if family in TEMPLATE_FAMILIES else None)
        for family, ckpt in family_ckpts.items()
    }


def documented(family: str) -> list[dict]:
    """tool_conversation() written the way `family`'s template reads it (transformers' tool-use
    docs: arguments a dict, the function's name on the tool message), by hand."""
    call = {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": dict(ARGS)}}
    if family == "deepseek_v31":  # DeepSeek's own templates splice the arguments' text in with +
        call["function"]["arguments"] = CALL_ARGUMENTS
    return [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": TOOL_RESULT},
    ]


# what each family's render must show of the call (the arguments as its format writes them)
CALL_SHOWN = {
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
    "celsius\n</parameter>\n</function>\n</tool_call>",
    "llama3_1": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>',
    "mistral": '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "celsius"}',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek_r1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek_v31": '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "unit": "celsius"}'
    "<｜tool▁call▁end｜>",
}
# ... and of the result
RESULT_SHOWN = {
    "qwen3": f"<|im_start|>user\n<tool_response>\n{TOOL_RESULT}\n</tool_response><|im_end|>",
    "qwen3_coder": f"<|im_start|>user\n<tool_response>\n{TOOL_RESULT}\n</tool_response>\n<|im_end|>",
    "llama3_1": f"<|start_header_id|>ipython<|end_header_id|>\n\n{TOOL_RESULT}<|eot_id|>",
    "mistral": f"[TOOL_RESULTS]a1B2c3D4e[TOOL_CONTENT]{TOOL_RESULT}[/TOOL_RESULTS]",
    "deepseek_v3": f"<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{TOOL_RESULT}<｜tool▁output▁end｜>"
    "<｜tool▁outputs▁end｜>",
    "deepseek_r1": f"<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{TOOL_RESULT}<｜tool▁output▁end｜>"
    "<｜tool▁outputs▁end｜>",
    "deepseek_v31": f"<｜tool▁output▁begin｜>{TOOL_RESULT}<｜tool▁output▁end｜>",
}


@pytest.mark.parametrize("family", TEMPLATE_FAMILIES)
def test_tool_turns_render_as_transformers_does(ckpts, family):
    ckpt, tok = ckpts[family]
    ours = ChatTemplate(ckpt).render(tool_conversation(), tools=TOOLS)
    expected = tok.apply_chat_template(documented(family), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == expected
    assert CALL_SHOWN[family] in ours and RESULT_SHOWN[family] in ours
    assert ours.index(CALL_SHOWN[family]) < ours.index(RESULT_SHOWN[family])
    if family != "deepseek_r1":  # R1's format lists no tools
        assert "get_time" in ours  # the tool list reached the template


def test_arguments_text_fallback_only_where_the_template_needs_it(ckpts):
    """DeepSeek-V3.1's template concatenates arguments: it gets the client's exact text (spacing
    kept); Qwen3's renders a dict with |tojson: it gets the dict (transformers' spacing)."""
    odd = '{"city":"Paris",  "unit":"celsius"}'
    ds = ChatTemplate(ckpts["deepseek_v31"][0]).render(tool_conversation(arguments=odd), tools=TOOLS)
    assert f"get_weather<｜tool▁sep｜>{odd}<｜tool▁call▁end｜>" in ds
    qwen = ChatTemplate(ckpts["qwen3"][0]).render(tool_conversation(arguments=odd), tools=TOOLS)
    assert CALL_SHOWN["qwen3"] in qwen and odd not in qwen


def test_several_calls_and_results(ckpts):
    ckpt, tok = ckpts["qwen3"]
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}},
    ]
    msgs = [
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    doc = copy.deepcopy(msgs)
    for c in doc[1]["tool_calls"]:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    doc[2]["name"], doc[3]["name"] = "get_time", "get_weather"
    ours = ChatTemplate(ckpt).render(msgs, tools=TOOLS)
    assert ours == tok.apply_chat_template(doc, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.count('<tool_call>\n{"name": "get_') == 2 and ours.count("<tool_response>") == 2


def test_reasoning_content_reaches_the_templates(ckpts):
    """Qwen3 renders reasoning_content of a turn after the last user message, and so vLLM's
    `reasoning` field; transformers passes it on as-is (its `thinking` alias aside)."""
    msgs = tool_conversation()
    msgs[2]["reasoning_content"] = "The user wants Paris."
    ckpt, tok = ckpts["qwen3"]
    qwen = ChatTemplate(ckpt).render(msgs, tools=TOOLS)
    assert "<think>\nThe user wants Paris.\n</think>\n\n<tool_call>" in qwen
    doc = documented("qwen3")
    doc[2]["reasoning_content"] = "The user wants Paris."
    assert qwen == tok.apply_chat_template(doc, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    msgs[2]["reasoning"] = msgs[2].pop("reasoning_content")
    assert ChatTemplate(ckpt).render(msgs, tools=TOOLS) == qwen


def test_chat_template_kwargs_reach_the_template(ckpts):
    msgs = [{"role": "user", "content": "Hi"}]
    qwen = ChatTemplate(ckpts["qwen3"][0])
    assert qwen.render(msgs).endswith("<|im_start|>assistant\n")
    assert qwen.render(msgs, template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ds = ChatTemplate(ckpts["deepseek_v31"][0])
    assert ds.render(msgs).endswith("<｜Assistant｜></think>")
    assert ds.render(msgs, template_kwargs={"thinking": True}).endswith("<｜Assistant｜><think>")


def test_reserved_kwargs_are_apply_chat_templates_parameters():
    """The names chat_template_kwargs may not set are exactly apply_chat_template's own (and the
    `messages` it renders with)."""
    params = inspect.signature(transformers.PreTrainedTokenizerBase.apply_chat_template).parameters
    own = {n for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert RESERVED_KWARGS == own | {"messages"}


def test_developer_messages(ckpts):
    """A template that names no developer role gets them as system (vLLM's rule)."""
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    qwen = ChatTemplate(ckpts["qwen3"][0]).render(msgs)
    assert qwen.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_chat_template_override(ckpts, llama_dir, tmp_path):
    """--chat-template FILE: the file replaces the checkpoint's template, or serves one without."""
    path = tmp_path / "t.jinja"
    path.write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if tools %}(tools:{{ tools | length }}){% endif %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    ckpt, _ = ckpts["qwen3"]
    t = chat_template(ckpt, path)
    assert t is chat_template(ckpt, path) and t is not chat_template(ckpt)
    assert t.render([{"role": "user", "content": "Hi"}], tools=TOOLS) == "[user]Hi(tools:2)[assistant]"
    bare = ChatTemplate(llama_dir, path)  # llama_dir has no chat_template
    assert bare.render([{"role": "user", "content": "Hi"}]) == "[user]Hi[assistant]"
    # a TypeError that no arguments text can cure is the template's refusal, said as such
    path.write_text("{{ 'n=' + 1 }}")
    with pytest.raises(ValueError, match="chat template refused them: TypeError"):
        ChatTemplate(llama_dir, path).render(tool_conversation())
    # it replaces gpt-oss's harmony rendering too
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert ChatTemplate(ckpts["gpt_oss"][0], path).render([{"role": "user", "content": "Hi"}]) == "[user]Hi"


@pytest.mark.parametrize(
    "content, problem",
    [(None, "cannot be read"), ("{% for m in messages %}{{ m.content }}", "not a valid jinja template")],
)
def test_bad_template_file_is_refused_naming_it(ckpts, tmp_path, content, problem):
    path = tmp_path / "bad.jinja"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=problem) as e:
        ChatTemplate(ckpts["qwen3"][0], path)
    assert str(path) in str(e.value)


def test_no_template_is_still_a_clear_error(llama_dir):
    with pytest.raises(NoChatTemplate, match="no chat_template"):
        ChatTemplate(llama_dir).render([{"role": "user", "content": "Hi"}])


def _call(**fn) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}", **fn}}


@pytest.mark.parametrize(
    "messages, where",
    [
        ([{"role": "robot", "content": "x"}], r"messages\[0\]: role must be one of"),
        (
            [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "nope", "content": "r"}],
            r"messages\[1\]\.tool_call_id: 'nope' matches no earlier assistant tool call",
        ),
        (
            [
                {"role": "user", "content": "x"},
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
                {"role": "assistant", "content": None, "tool_calls": [_call()]},
            ],
            r"messages\[1\]\.tool_call_id: 'c1' matches no earlier",
        ),
        ([{"role": "tool", "content": "r"}], r"messages\[0\]\.tool_call_id: a tool message needs"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [_call(name="")]}],
            r"messages\[0\]\.tool_calls\[0\]\.function\.name",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"arguments": "{}"}}]}],
            r"messages\[0\]\.tool_calls\[0\]\.function\.name",
        ),
        (
            [{"role": "assistant", "tool_calls": [_call(arguments='{"city": ')]}],
            r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: arguments must be a JSON object's text",
        ),
        (
            [{"role": "assistant", "tool_calls": [_call(arguments="[1, 2]")]}],
            r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: arguments must be a JSON object, got list",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
            r"messages\[0\]\.tool_calls\[0\]\.id",
        ),
        (
            [{"role": "assistant", "tool_calls": [{**_call(), "type": "code"}]}],
            r"messages\[0\]\.tool_calls\[0\]: only tool calls of type 'function'",
        ),
        ([{"role": "assistant", "tool_calls": {"id": "c1"}}], r"messages\[0\]\.tool_calls: must be a list"),
        (
            [{"role": "assistant", "content": "", "reasoning_content": 3}],
            r"messages\[0\]\.reasoning_content: must be a string",
        ),
        ([], "messages must be a non-empty list"),
    ],
)
def test_bad_messages_are_value_errors_naming_them(messages, where):
    with pytest.raises(ValueError, match=where):
        normalize(messages)


def test_bad_render_inputs(ckpts):
    t = ChatTemplate(ckpts["qwen3"][0])
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="chat_template_kwargs: add_generation_prompt, tokenize cannot be set"):
        t.render(msgs, template_kwargs={"tokenize": True, "add_generation_prompt": False})
    with pytest.raises(ValueError, match="tools must be a list of objects"):
        t.render(msgs, tools=["get_weather"])
    # the template's own refusal (Llama 3.1 takes one call a turn) is a ValueError too, not a crash
    two = tool_conversation()
    two[2]["tool_calls"].append({**two[2]["tool_calls"][0], "id": "other"})
    with pytest.raises(ValueError, match="chat template refused them: Llama 3.1's format takes one tool call per"):
        ChatTemplate(ckpts["llama3_1"][0]).render(two, tools=TOOLS)


def test_empty_tool_calls_and_null_content_take_the_plain_path(ckpts):
    """vLLM's rules: `tool_calls: []` is no call (a template may take its call branch on any
    tool_calls key) and null content is ""."""
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "Again"},
    ]
    assert normalize(msgs)[1] == {"role": "assistant", "content": ""}
    ckpt, tok = ckpts["qwen3"]
    doc = [msgs[0], {"role": "assistant", "content": ""}, msgs[2]]
    assert ChatTemplate(ckpt).render(msgs) == tok.apply_chat_template(doc, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------- gpt-oss: harmony
def on_one_day(render) -> tuple[str, str]:
    """(render(), the date it ran on): harmony's system message states today's date, so a render
    that straddles midnight is taken again."""
    while True:
        day = datetime.date.today().isoformat()
        out = render()
        if datetime.date.today().isoformat() == day:
            return out, day


def harmony_text(messages: list[Message], complete: bool = True) -> str:
    """openai-harmony's own rendering of hand-written harmony messages, as text."""
    enc, conv = harmony_encoding(), Conversation.from_messages(messages)
    return enc.decode_utf8(
        enc.render_conversation_for_completion(conv, Role.ASSISTANT) if complete else enc.render_conversation(conv)
    )


def harmony_tools() -> list[ToolDescription]:
    return [
        ToolDescription.new(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
        for t in TOOLS
    ]


def assistant(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def test_harmony_tool_conversation_equals_openai_harmonys(ckpts):
    """The tool round trip, written by hand as OpenAI's harmony guide shows it: the instructions
    and tools in the developer message, the reasoning on analysis, the call on commentary to
    functions.get_weather with <|constrain|>json, the result from functions.get_weather."""
    msgs = tool_conversation()
    msgs[2]["reasoning_content"] = "The user wants Paris."
    ours, day = on_one_day(lambda: ChatTemplate(ckpts["gpt_oss"][0]).render(msgs, tools=TOOLS))
    by_hand = [
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date(day)),
        Message.from_role_and_content(
            Role.DEVELOPER,
            DeveloperContent.new()
            .with_instructions("You are a weather assistant.")
            .with_function_tools(harmony_tools()),
        ),
        Message.from_role_and_content(Role.USER, "What is the weather in Paris?"),
        assistant("The user wants Paris.", "analysis"),
        assistant(CALL_ARGUMENTS, "commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), TOOL_RESULT)
        .with_channel("commentary")
        .with_recipient("assistant"),
    ]
    assert ours == harmony_text(by_hand)
    assert ours.endswith(
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{CALL_ARGUMENTS}"
        f"<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{TOOL_RESULT}<|end|>"
        "<|start|>assistant"
    )
    assert "type get_time = (_: {" in ours
    # the text is lossless for gpt-oss's own vocabulary: it encodes back to harmony's ids
    enc = harmony_encoding()
    ids = enc.render_conversation_for_completion(Conversation.from_messages(by_hand), Role.ASSISTANT)
    assert enc.encode(ours, allowed_special="all") == ids


def test_harmony_tools_without_description_or_parameters(ckpts):
    tools = [
        {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "stamp", "description": None}},
    ]
    hi = [{"role": "user", "content": "Hi"}]
    ours, day = on_one_day(lambda: ChatTemplate(ckpts["gpt_oss"][0]).render(hi, tools=tools))
    by_hand = [
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date(day)),
        Message.from_role_and_content(
            Role.DEVELOPER,
            DeveloperContent.new().with_function_tools([ToolDescription.new(n, "") for n in ("ping", "stamp")]),
        ),
        Message.from_role_and_content(Role.USER, "Hi"),
    ]
    assert ours == harmony_text(by_hand)
    assert "type ping = () => any;\n\ntype stamp = () => any;" in ours
    with pytest.raises(ValueError, match=r"tools\[0\]: gpt-oss takes function tools"):
        ChatTemplate(ckpts["gpt_oss"][0]).render(hi, tools=[{"type": "code_interpreter"}])


def test_harmony_turns_kwargs_and_finished_reasoning(ckpts):
    """A finished turn's reasoning is dropped, the current one's kept; a later system message is a
    developer message; content beside calls is a commentary preamble; reasoning_effort and
    model_identity reach the system message; without a generation prompt the text ends at the
    last message. Bad kwargs are the client's errors."""
    gpt = ChatTemplate(ckpts["gpt_oss"][0])
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"city":"Oslo"}'}}
    msgs = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning": "A greeting."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "Time in Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use get_time.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "assistant", "content": None},  # nothing to render
    ]
    kwargs = {"reasoning_effort": "high", "model_identity": "You are a test model.", "enable_thinking": False}
    ours, day = on_one_day(lambda: gpt.render(msgs, tools=TOOLS, add_generation_prompt=False, template_kwargs=kwargs))
    system = SystemContent.new().with_conversation_start_date(day).with_reasoning_effort(ReasoningEffort.HIGH)
    by_hand = [
        Message.from_role_and_content(Role.SYSTEM, system.with_model_identity("You are a test model.")),
        Message.from_role_and_content(
            Role.DEVELOPER, DeveloperContent.new().with_instructions("Be brief.").with_function_tools(harmony_tools())
        ),
        Message.from_role_and_content(Role.USER, "Hi"),
        assistant("Hello.", "final"),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Answer in English.")),
        Message.from_role_and_content(Role.USER, "Time in Oslo?"),
        assistant("Use get_time.", "analysis"),
        assistant("Checking.", "commentary"),
        assistant('{"city":"Oslo"}', "commentary")
        .with_recipient("functions.get_time")
        .with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_time"), "12:00")
        .with_channel("commentary")
        .with_recipient("assistant"),
    ]
    assert ours == harmony_text(by_hand, complete=False)
    assert "Reasoning: high" in ours and "A greeting." not in ours and ours.endswith("12:00<|end|>")
    with pytest.raises(ValueError, match="chat_template_kwargs.reasoning_effort must be one of low, medium, high"):
        gpt.render(msgs[:2], template_kwargs={"reasoning_effort": "max"})
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_call_id: 'zz' matches no earlier"):
        gpt.render([msgs[1], {"role": "tool", "tool_call_id": "zz", "content": "r"}])
