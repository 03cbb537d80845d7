"""Helpers for the OpenAI HTTP tests: a checkpoint copy with a chat template, clients, raw SSE."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from baton.common.checkpoint import METADATA_FILE, sha256_file

# A ChatML-like template; <|endoftext|> (the tiny tokenizer's special token) ends each turn, so the
# rendered prompt holds a special token that must be encoded as its id.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def with_chat_template(src: Path, dst: Path, template: str | None = CHAT_TEMPLATE) -> Path:
    """A copy of checkpoint `src` whose tokenizer_config.json carries `template` (its sha256 re-recorded)."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if template is not None:
        cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    meta_path = dst / METADATA_FILE
    meta = json.loads(meta_path.read_text())
    meta["sha256"]["tokenizer_config.json"] = sha256_file(cfg_path)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return dst
