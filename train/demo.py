"""The README's main job on the embedded default: train -> hand off -> load -> generate.

Grows with the project: once the server lands, the last step becomes serve -> query.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from baton.common.checkpoint import load_checkpoint
from baton.common.model import greedy_generate
from baton.common.tokenizer import Tokenizer
from baton.train.config import load_config
from baton.train.trainer import train

log = logging.getLogger(__name__)

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
PROMPTS = ["Return the number of", "This module provides", "If the file"]


def run_demo(out_dir: Path, steps: int | None = None, corpus: str | None = None) -> list[str]:
    overrides = [f"out_dir={out_dir}", "checkpoint.resume=never"]  # the demo always trains from scratch
    if steps is not None:
        overrides.append(f"max_steps={steps}")
    if corpus is not None:
        overrides.append(f"data.path={corpus}")
    cfg = load_config(DEMO_CONFIG, overrides)
    print(f"[1/3] training a {cfg.model.get('preset', 'custom')} model for {cfg.max_steps} steps "
          f"on {cfg.data.path or 'the embedded Python-docstring corpus'}")
    result = train(cfg)
    print(f"      train loss {result.final_train_loss:.3f}, val loss {result.final_val_loss:.3f}, "
          f"{result.tokens_per_second:,.0f} tokens/s")
    print(f"[2/3] handing off: loading {result.handoff_dir} as the server would")
    ckpt = load_checkpoint(result.handoff_dir)
    tok = Tokenizer.from_dir(result.handoff_dir)
    print("[3/3] generating (greedy, 40 tokens) from the handed-off checkpoint:")
    outputs = []
    for prompt in PROMPTS:
        ids = greedy_generate(ckpt.model.eval(), torch.tensor([tok.encode(prompt)]), 40)
        text = prompt + tok.decode(ids[0].tolist())
        outputs.append(text)
        print(f"  > {text!r}")
    return outputs
