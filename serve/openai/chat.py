"""Chat prompts: OpenAI messages rendered with the checkpoint's own chat_template.

The template is the one in the checkpoint's tokenizer_config.json (or chat_template.jinja), or the
file given as --chat-template, run by transformers' apply_chat_template - the renderer the model's
authors tested it with. There is no fallback template: a checkpoint without one gets a clear error
rather than a prompt format the model was never trained on. The rendered text is then encoded like
any prompt (special tokens in it, e.g. <|im_start|>, map to their ids; no BOS is added on top of
the template's own).

gpt-oss (config.json's model_type gpt_oss) is rendered by openai-harmony instead
(harmony_chat.py), as vLLM does: harmony is the library built for its format. A --chat-template
file still replaces that, as it replaces any checkpoint's template.

What agents send is mapped onto the message shape chat templates read (transformers' documented
one), as vLLM's chat_utils does:
- `tools`: the request's OpenAI tool dicts, as apply_chat_template(tools=...).
- assistant `tool_calls`: {id, type, function: {name, arguments}} with `arguments` parsed from
  OpenAI's JSON text into a dict - transformers' documented form, which templates render with
  `|tojson` or walk with `|items` (Qwen3-Coder's parameters). DeepSeek's own templates splice
  `arguments` in with `+` instead, which a dict turns into a TypeError (vLLM answers with an
  error there and ships edited copies of those templates): on a TypeError we render once more
  with each call's arguments as the client's JSON text, the text those models wrote. An empty
  call list is dropped (a template may take its call branch on any `tool_calls` key) and a null
  content is "" (templates test `in content`); transformers drops the keys that stay None.
- `tool` messages keep `tool_call_id`, and `name` where given.
- `reasoning_content` (or vLLM's `reasoning`) on assistant messages: transformers passes it on
  as `reasoning_content` and `thinking`, the names Qwen3's and gpt-oss's templates read.
- `developer` messages become `system` where the template names no developer role (vLLM's rule).
- `chat_template_kwargs`: extra template variables (e.g. {"enable_thinking": false}); names that
  are apply_chat_template's own parameters are refused rather than silently changing the render.
Bad input is a ValueError naming the message (the HTTP layer's 400): an unknown role, a malformed
tool call (no id or name; arguments that are not a JSON object's text, which vLLM turns into {}
and so renders a call nobody made), a tool message whose tool_call_id answers no earlier call; so
is a template's own refusal (raise_exception, a TypeError).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jinja2
import jinja2.ext
from baton.common.hf import transformers_class
from baton.serve.openai import harmony_chat
from baton.serve.openai.harmony_vocab import harmony_encoding

ROLES = ("system", "user", "assistant", "tool", "developer")
# apply_chat_template's own parameters and the names it renders with: chat_template_kwargs that
# used one would change how the template is applied, not what it is given
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class NoChatTemplate(ValueError):
    pass


def _text_of(content, where: str) -> str:
    """OpenAI content: a string or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: only text content parts are supported ({{'type': 'text', 'text': ...}})")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string or a list of text parts")


def _arguments(args, where: str) -> dict:
    """A call's arguments as a dict: OpenAI's JSON object text (or an object some clients send);
    missing or "" is {} (a call without parameters), as in vLLM."""
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ValueError(f"{where}: arguments must be a JSON object's text, got {args[:80]!r}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}: arguments must be a JSON object, got {type(args).__name__}")
    return args


def _tool_call(call, where: str) -> dict:
    if not isinstance(call, dict):
        raise ValueError(f"{where}: a tool call must be an object")
    if call.get("type", "function") != "function":
        raise ValueError(f"{where}: only tool calls of type 'function' are supported")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise ValueError(f"{where}.id: a tool call needs its id (a non-empty string)")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name: a tool call needs the function's name")
    args = _arguments(fn.get("arguments"), f"{where}.function.arguments")
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}}


def normalize(messages: list, developer_role: bool = True) -> list[dict]:
    """OpenAI chat messages -> the dicts chat templates read (see the module docstring);
    ValueError names the bad message. developer_role False: developer messages become system."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out: list[dict] = []
    call_ids: set[str] = set()  # of the calls made so far
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}")
        role, content = m["role"], m.get("content")
        if content is None and role == "assistant":
            content = ""
        msg: dict = {"role": "system" if role == "developer" and not developer_role else role}
        msg["content"] = _text_of(content, where)
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "assistant":
            tool_calls = m.get("tool_calls")
            if tool_calls is not None and not isinstance(tool_calls, list):
                raise ValueError(f"{where}.tool_calls: must be a list")
            if tool_calls:
                msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(tool_calls)]
                call_ids.update(c["id"] for c in msg["tool_calls"])
            reasoning = m.get("reasoning_content")
            reasoning = m.get("reasoning") if reasoning is None else reasoning
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise ValueError(f"{where}.reasoning_content: must be a string")
                msg["reasoning_content"] = reasoning
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ValueError(f"{where}.tool_call_id: a tool message needs the id of the call it answers")
            if call_id not in call_ids:
                raise ValueError(f"{where}.tool_call_id: {call_id!r} matches no earlier assistant tool call")
            msg["tool_call_id"] = call_id
        out.append(msg)
    return out


def _arguments_as_text(raw: list, messages: list[dict]) -> tuple[list[dict], bool]:
    """`messages` with each call's arguments as JSON text (the client's own text where it sent
    one), for templates that concatenate them and for harmony; and whether there was any call to
    convert."""
    out, converted = [], False
    for m, msg in zip(raw, messages):
        if "tool_calls" in msg:
            calls = []
            for c, call in zip(m["tool_calls"], msg["tool_calls"]):
                text = c["function"].get("arguments")
                if not isinstance(text, str) or not text:
                    text = json.dumps(call["function"]["arguments"], ensure_ascii=False)
                calls.append({**call, "function": {**call["function"], "arguments": text}})
            msg, converted = {**msg, "tool_calls": calls}, True
        out.append(msg)
    return out, converted


def _template_source(tok) -> str:
    """The template text (a tokenizer may carry several named ones: all of them)."""
    t = tok.chat_template
    return "\n".join(t.values()) if isinstance(t, dict) else str(t)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' {% generation %}...{% endgeneration %} (training masks), for parsing only."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def read_template_file(path: str | Path) -> str:
    """A --chat-template file's text; ValueError naming the file if it cannot be read or is not
    valid jinja (checked at server start, not in the first request)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {str(path)!r} cannot be read: {e}") from None
    try:
        # transformers' template environment adds the {% generation %} tag: parse with a stand-in
        jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationTag]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {str(path)!r} is not a valid jinja template: line {e.lineno}: {e}") from None
    return text


class ChatTemplate:
    """One checkpoint's chat_template (or the --chat-template file replacing it; or, for gpt-oss,
    openai-harmony), loaded and compiled once and then shared by every request thread: rendering
    only reads it (jinja templates and harmony render concurrently), so nothing a chat request
    needs is imported or built inside the request."""

    def __init__(self, model_dir: str | Path, template_file: str | Path | None = None):
        self.name = Path(model_dir).name
        self._tok, self._unavailable, self.harmony = None, None, False
        override = read_template_file(template_file) if template_file is not None else None
        if override is None and harmony_chat.uses_harmony(model_dir):
            try:  # load harmony's vocabulary now, not in the first request
                harmony_encoding()
            except Exception as e:  # noqa: BLE001 - said to each chat request; completions still work
                self._unavailable = f"gpt-oss's harmony format did not load for chat ({type(e).__name__}: {e})"
                return
            self.harmony = self.developer_role = True
            return
        try:
            tok = transformers_class("AutoTokenizer").from_pretrained(str(model_dir), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - said to each chat request; completions still work
            self._unavailable = f"the checkpoint's tokenizer did not load for chat ({type(e).__name__}: {e})"
            return
        if override is not None:
            tok.chat_template = override
        if getattr(tok, "chat_template", None):
            self._tok = tok
            source = _template_source(tok)
            self.developer_role = "'developer'" in source or '"developer"' in source
            try:  # compile the template now (transformers caches it), not in the first request
                self.render([{"role": "user", "content": "Hello"}])
            except Exception:  # noqa: BLE001 - a template that refuses this message still serves others
                pass

    def render(
        self,
        messages: list,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
    ) -> str:
        """The prompt text for `messages` (OpenAI chat messages) with `tools` (OpenAI tool dicts)
        and `template_kwargs` (chat_template_kwargs) as extra template variables. NoChatTemplate if
        there is no template; ValueError naming the problem for input it or the template refuses."""
        if self._tok is None and not self.harmony:
            raise NoChatTemplate(
                self._unavailable
                or f"the checkpoint {self.name!r} has no chat_template (tokenizer_config.json): "
                "use /v1/completions with a formatted prompt, or add a chat_template to the checkpoint"
            )
        chat = normalize(messages, self.developer_role)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of objects")
        kwargs = dict(template_kwargs or {})
        bad = sorted(str(k) for k in kwargs if not isinstance(k, str) or k in RESERVED_KWARGS)
        if bad:
            raise ValueError(f"chat_template_kwargs: {', '.join(bad)} cannot be set (apply_chat_template's own)")
        if self.harmony:  # harmony takes the arguments' text, as the model wrote it
            as_text, _ = _arguments_as_text(messages, chat)
            return harmony_chat.render(as_text, tools, add_generation_prompt, kwargs)

        def apply(conversation: list[dict]) -> str:
            return self._tok.apply_chat_template(
                conversation, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )

        try:
            return apply(chat)
        except TypeError as e:  # e.g. DeepSeek's '...' + arguments: try the arguments as text
            as_text, converted = _arguments_as_text(messages, chat)
            if converted:
                try:
                    return apply(as_text)
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
            raise _refused(e) from None
        except Exception as e:  # noqa: BLE001 - raise_exception(...), a missing key: the client's input
            raise _refused(e) from None


def _refused(e: Exception) -> ValueError:
    """The template's refusal (its raise_exception text as is), as the client's error."""
    why = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
    return ValueError(f"messages: the checkpoint's chat template refused them: {why}")


_templates: dict[tuple[str, str | None], ChatTemplate] = {}
_templates_lock = threading.Lock()


def chat_template(model_dir: str | Path, template_file: str | Path | None = None) -> ChatTemplate:
    """The checkpoint's ChatTemplate (with `template_file` replacing its template), built once
    (under a lock) and shared; servers build it when the model loads."""
    key = (str(Path(model_dir).resolve()), None if template_file is None else str(Path(template_file).resolve()))
    with _templates_lock:
        if key not in _templates:
            _templates[key] = ChatTemplate(key[0], template_file)
        return _templates[key]


def render(model_dir: str | Path, messages: list, add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` under the checkpoint's chat_template (see ChatTemplate)."""
    return chat_template(model_dir).render(messages, add_generation_prompt=add_generation_prompt)
