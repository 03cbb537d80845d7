"""Chat prompts: OpenAI messages rendered with the checkpoint's own chat_template.

The template is the one in the checkpoint's tokenizer_config.json (or chat_template.jinja), run by
transformers' apply_chat_template - the renderer the model's authors tested it with. There is no
fallback template: a checkpoint without one gets a clear error rather than a prompt format the
model was never trained on. The rendered text is then encoded like any prompt (special tokens in
it, e.g. <|im_start|>, map to their ids; no BOS is added on top of the template's own).
"""

from __future__ import annotations

import functools
from pathlib import Path

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


@functools.lru_cache(maxsize=8)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def render(model_dir: str | Path, messages: list, add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`; NoChatTemplate if the checkpoint has no chat_template."""
    messages = normalize(messages)
    tok = _tokenizer(str(Path(model_dir).resolve()))
    if not getattr(tok, "chat_template", None):
        raise NoChatTemplate(
            f"the checkpoint {Path(model_dir).name!r} has no chat_template (tokenizer_config.json): "
            "use /v1/completions with a formatted prompt, or add a chat_template to the checkpoint"
        )
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
