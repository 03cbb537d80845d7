"""gpt-oss chat prompts, rendered by openai-harmony (the library built for gpt-oss's format).

A gpt-oss prompt is a harmony conversation: a system message (model identity, knowledge cutoff,
the date, reasoning effort, the valid channels), a developer message (the instructions and the
function tools as a TypeScript-like namespace), then user, assistant and tool messages with
their channels and recipients. vLLM renders gpt-oss chat through openai-harmony rather than the
checkpoint's jinja template, and so does Baton: the headers, channels and tool namespace are then
harmony's own, not a template's imitation of them.

The messages come from chat.normalize (OpenAI's shape checked; call arguments as the client's
JSON text) and map as vLLM's chat path and OpenAI's harmony guide say:
- system message: harmony's SystemContent with today's date as the conversation start date (as
  vLLM and gpt-oss's own template do) and chat_template_kwargs' `reasoning_effort` (low, medium,
  high; harmony's default medium) and `model_identity`, the names gpt-oss's template reads;
  other kwargs are ignored, as a jinja template ignores variables it does not use.
- the first system or developer message: the developer message's instructions; `tools` go in
  that developer message as function tools (no description is ""; an object schema without
  properties is a function without parameters, `() => any`). A later system or developer
  message is a developer message of its own.
- assistant: reasoning_content -> the analysis channel; with tool_calls, the text -> a
  commentary preamble and each call -> commentary `to=functions.NAME` with content type
  `<|constrain|>json` (harmony's documented form) and the arguments as their text; without
  calls, the text -> the final channel. A turn with neither text nor reasoning renders nothing.
- tool: a message from `functions.NAME` (the call its tool_call_id answers) to the assistant on
  commentary.
- the analysis before the last final answer is dropped: reasoning of a finished turn is not shown
  to the model again (OpenAI's guide; vLLM's auto_drop_analysis_messages); the current turn's
  reasoning before its calls stays.

The ids harmony renders are decoded to text, which the checkpoint's own tokenizer then encodes
like any chat prompt: for gpt-oss's vocabulary (o200k_harmony) that text encodes back to the
same ids (tested), and a test checkpoint with a small tokenizer gets the same text.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from baton.serve.openai.harmony_vocab import harmony_encoding
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyError,
    Message,
    ReasoningEffort,
    RenderConversationConfig,
    Role,
    SystemContent,
    ToolDescription,
)

MODEL_TYPE = "gpt_oss"  # config.json's model_type of the checkpoints rendered here
EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
CALL_CONTENT_TYPE = "<|constrain|>json"
# the dropping is done here (vLLM's rule), harmony's own left off so it cannot differ from it
NO_AUTO_DROP = RenderConversationConfig(auto_drop_analysis=False)


def uses_harmony(model_dir: str | Path) -> bool:
    """Whether the checkpoint's family speaks harmony (config.json's model_type is gpt_oss)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def _system(template_kwargs: dict, today: str) -> Message:
    content = SystemContent.new().with_conversation_start_date(today)
    effort = template_kwargs.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise ValueError(
                f"chat_template_kwargs.reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}"
            )
        content = content.with_reasoning_effort(EFFORTS[effort])
    identity = template_kwargs.get("model_identity")
    if identity is not None:
        if not isinstance(identity, str):
            raise ValueError("chat_template_kwargs.model_identity must be a string")
        content = content.with_model_identity(identity)
    return Message.from_role_and_content(Role.SYSTEM, content)


def _function(tool: dict, where: str) -> ToolDescription:
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}: gpt-oss takes function tools ({{'type': 'function', 'function': {{'name': ...}}}})")
    params = fn.get("parameters")
    if isinstance(params, dict) and not params.get("properties"):
        params = None  # no arguments: harmony writes `() => any`
    return ToolDescription.new(fn["name"], fn.get("description") or "", parameters=params)


def _developer(instructions: str | None, tools: list[ToolDescription] | None) -> Message:
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools(tools)
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _assistant(msg: dict) -> list[Message]:
    def on(channel: str, text: str) -> Message:
        return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)

    out = [on("analysis", msg["reasoning_content"])] if msg.get("reasoning_content") else []
    calls = msg.get("tool_calls") or []
    if msg["content"]:
        out.append(on("commentary" if calls else "final", msg["content"]))
    for call in calls:
        fn = call["function"]
        call_msg = on("commentary", fn["arguments"]).with_recipient(f"functions.{fn['name']}")
        out.append(call_msg.with_content_type(CALL_CONTENT_TYPE))
    return out


def harmony_messages(
    messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None, today: str | None = None
) -> list[Message]:
    """The harmony conversation for normalized chat `messages` (see the module docstring)."""
    kwargs = template_kwargs or {}
    functions = [_function(t, f"tools[{i}]") for i, t in enumerate(tools or [])]
    out = [_system(kwargs, today or datetime.date.today().isoformat())]
    first_instructions = messages and messages[0]["role"] in ("system", "developer")
    rest = messages[1:] if first_instructions else messages
    if (first_instructions and messages[0]["content"]) or functions:
        out.append(_developer(messages[0]["content"] if first_instructions else None, functions))
    names: dict[str, str] = {}  # call id -> the function it called
    for msg in rest:
        role = msg["role"]
        if role in ("system", "developer"):
            if msg["content"]:
                out.append(_developer(msg["content"], None))
        elif role == "user":
            out.append(Message.from_role_and_content(Role.USER, msg["content"]))
        elif role == "assistant":
            names.update((c["id"], c["function"]["name"]) for c in msg.get("tool_calls") or [])
            out += _assistant(msg)
        else:  # tool (normalize checked that its id answers an earlier call)
            author = Author.new(Role.TOOL, f"functions.{names[msg['tool_call_id']]}")
            out.append(
                Message.from_author_and_content(author, msg["content"])
                .with_channel("commentary")
                .with_recipient("assistant")
            )
    finals = [i for i, m in enumerate(out) if m.author.role == Role.ASSISTANT and m.channel == "final"]
    return [m for i, m in enumerate(out) if not (finals and i < finals[-1] and m.channel == "analysis")]


def render(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
    today: str | None = None,
) -> str:
    """The prompt text of a harmony conversation: with add_generation_prompt, what gpt-oss
    completes (ending in `<|start|>assistant`). `today`: the date the system message states
    (YYYY-MM-DD; None: today's)."""
    encoding = harmony_encoding()
    conversation = Conversation.from_messages(harmony_messages(messages, tools, template_kwargs, today))
    try:
        if add_generation_prompt:
            ids = encoding.render_conversation_for_completion(conversation, Role.ASSISTANT, NO_AUTO_DROP)
        else:
            ids = encoding.render_conversation(conversation, NO_AUTO_DROP)
    except HarmonyError as e:
        raise ValueError(f"messages: openai-harmony cannot render them: {e}") from None
    return encoding.decode_utf8(ids)
