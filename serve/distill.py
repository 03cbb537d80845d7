"""Distillation data: a model's own continuations of prompts cut out of a corpus (`baton distill`).

Speculative decoding pays only when the proposer guesses what the *target* will say, not what the
corpus says. Draft models and Medusa heads therefore learn best from the target's own output
(Medusa, section 3.2; DistillSpec): run `baton distill`, then point the draft's or the Medusa
recipe's data.path at the written file. Generation uses the serving engine: batched, paged KV.
Each line holds the token ids beside their text, and `build_datasets` trains on those ids: a
decode -> encode round trip is not guaranteed to give back the tokens the model produced.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from baton.common.data import DataConfig, build_datasets
from baton.common.tokenizer import Tokenizer
from baton.serve.engine import EngineConfig
from baton.serve.llm import LLM
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

log = logging.getLogger(__name__)


@dataclass
class DistillConfig:
    """Prompts are the first quarter of random training blocks of `data`; each line of the corpus
    is a prompt and its continuation, seq_len + 1 tokens in all."""

    data: DataConfig = field(default_factory=lambda: DataConfig(seq_len=128))
    samples: int = 2048  # continuations to write
    temperature: float = 0.0  # 0: the model's greedy continuations, else seeded samples
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 1 or self.temperature < 0:
            raise ValueError(f"need samples >= 1 and temperature >= 0 (got {self.samples}, {self.temperature})")


def teacher_continuations(
    model_dir: str | Path, train_ds, count: int, width: int, temperature: float = 0.0, seed: int = 0
) -> torch.Tensor:
    """[count, width] token blocks: a prompt (the first quarter of a random training block) and the
    model's continuation of it (greedy for temperature 0, else seeded samples)."""
    if count < 1 or len(train_ds) == 0:
        raise ValueError(
            f"need at least one continuation and one training block (count {count}, blocks {len(train_ds)})"
        )
    prompt_len = max(1, width // 4)
    pick = torch.randint(len(train_ds), (count,), generator=torch.Generator().manual_seed(seed))
    prompts = [list(train_ds[int(i)]["input_ids"][:prompt_len]) for i in pick]
    params = [
        SamplingParams(temperature=temperature, max_tokens=width - prompt_len, ignore_eos=True, seed=seed + i)
        for i in range(count)
    ]
    log.info("distillation: %s continues %d prompts of %d tokens to %d tokens", model_dir, count, prompt_len, width)
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=256 * 2**20, scheduler=SchedulerConfig(max_num_seqs=64)))
    outs = llm.generate(prompts, params, use_tqdm=True)
    return torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)], dtype=torch.long)


def write_distillation_corpus(model_dir: str | Path, out: str | Path, cfg: DistillConfig) -> Path:
    """Write cfg.samples continuations by the model at model_dir as JSONL, one
    {"text": ..., "token_ids": [...]} per line (the fields DataConfig reads by default).
    The file appears whole or not at all; a refused call leaves an existing one alone."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir} is not a checkpoint with a tokenizer (no tokenizer.json)")
    tok = Tokenizer.from_dir(model_dir)
    train_ds, _ = build_datasets(cfg.data, tok)
    blocks = teacher_continuations(model_dir, train_ds, cfg.samples, cfg.data.seq_len + 1, cfg.temperature, cfg.seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        for row in blocks.tolist():
            f.write(json.dumps({"text": tok.decode(row), "token_ids": row}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    log.info("wrote %d continuations by %s to %s", cfg.samples, model_dir, out)
    return out
