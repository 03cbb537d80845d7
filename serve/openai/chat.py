"""Chat prompts: OpenAI messages rendered with the checkpoint's own chat_template.

The template is the one in the checkpoint's tokenizer_config.json (or chat_template.jinja), run by
transformers' apply_chat_template - the renderer the model's authors tested it with. There is no
fallback template: a checkpoint without one gets a clear error rather than a prompt format the
model was never trained on. The rendered text is then encoded like any prompt (special tokens in
it, e.g. <|im_start|>, map to their ids; no BOS is added on top of the template's own).
"""

from __future__ import annotations

import threading
from pathlib import Path

import jinja2

from baton.common.hf import transformers_class

ROLES = ("system", "user", "assistant", "tool", "developer")


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


def normalize(messages: list) -> list[dict[str, str]]:
    """Check roles and content; ValueError names the bad message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}")
        content = m.get("content")
        if content is None and m["role"] == "assistant":
            content = ""
        out.append({"role": m["role"], "content": _text_of(content, where)})
    return out


class ChatTemplate:
    """One checkpoint's chat_template, loaded and compiled once and then shared by every request
    thread: rendering only reads it (jinja templates render concurrently), so nothing a chat request
    needs is imported or built inside the request."""

    def __init__(self, model_dir: str):
        self.name = Path(model_dir).name
        self._tok, self._unavailable = None, None
        try:
            tok = transformers_class("AutoTokenizer").from_pretrained(model_dir, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - said to each chat request; completions still work
            self._unavailable = f"the checkpoint's tokenizer did not load for chat ({type(e).__name__}: {e})"
            return
        if getattr(tok, "chat_template", None):
            self._tok = tok
            try:  # compile the template now (transformers caches it), not in the first request
                self.render([{"role": "user", "content": "Hello"}])
            except Exception:  # noqa: BLE001 - a template that refuses this message still serves others
                pass

    def render(self, messages: list, add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; NoChatTemplate if the checkpoint has no chat_template."""
        messages = normalize(messages)
        if self._tok is None:
            raise NoChatTemplate(
                self._unavailable
                or f"the checkpoint {self.name!r} has no chat_template (tokenizer_config.json): "
                "use /v1/completions with a formatted prompt, or add a chat_template to the checkpoint"
            )
        try:
            return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:  # e.g. "roles must alternate": the template's rule, the client's input
            raise ValueError(f"messages: the checkpoint's chat template refused them: {e}") from None


_templates: dict[str, ChatTemplate] = {}
_templates_lock = threading.Lock()


def chat_template(model_dir: str | Path) -> ChatTemplate:
    """The checkpoint's ChatTemplate, built once (under a lock) and shared; servers build it when the
    model loads."""
    key = str(Path(model_dir).resolve())
    with _templates_lock:
        if key not in _templates:
            _templates[key] = ChatTemplate(key)
        return _templates[key]


def render(model_dir: str | Path, messages: list, add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` under the checkpoint's chat_template (see ChatTemplate)."""
    return chat_template(model_dir).render(messages, add_generation_prompt)
