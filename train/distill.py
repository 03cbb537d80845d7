"""Distillation data: a model's own continuations of prompts cut out of a corpus.

Speculative decoding pays only when the proposer guesses what the *target* will say, not what the
corpus says. Medusa heads (`self_distill` in a Medusa recipe) and draft models (`baton distill`,
then a recipe whose data.path is the written file) therefore learn best from the target's own
output (Medusa, section 3.2; DistillSpec). Generation uses the serving engine: batched, paged KV.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def teacher_continuations(model_dir: str | Path, train_ds, count: int, width: int, temperature: float = 0.0,
                          seed: int = 0) -> torch.Tensor:
    """[count, width] token blocks: a prompt (the first quarter of a random training block) and the
    model's continuation of it (greedy for temperature 0, else seeded samples)."""
    from baton.serve.engine import EngineConfig
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams
    from baton.serve.scheduler import SchedulerConfig

    if count < 1 or len(train_ds) == 0:
        raise ValueError(f"need at least one continuation and one training block (count {count}, blocks {len(train_ds)})")
    prompt_len = max(1, width // 4)
    pick = torch.randint(len(train_ds), (count,), generator=torch.Generator().manual_seed(seed))
    prompts = [list(train_ds[int(i)]["input_ids"][:prompt_len]) for i in pick]
    params = [SamplingParams(temperature=temperature, max_tokens=width - prompt_len, ignore_eos=True, seed=seed + i)
              for i in range(count)]
    log.info("distillation: %s continues %d prompts of %d tokens to %d tokens", model_dir, count, prompt_len, width)
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=256 * 2**20, scheduler=SchedulerConfig(max_num_seqs=64)))
    outs = llm.generate(prompts, params, use_tqdm=True)
    return torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)], dtype=torch.long)


def write_distillation_corpus(model_dir: str | Path, out: str | Path, data_path: str | None = None,
                              samples: int = 2048, seq_len: int = 128, temperature: float = 0.0,
                              seed: int = 0) -> Path:
    """Write `samples` continuations by the model at model_dir as JSONL ({"text": ...} per line),
    prompted from data_path (None: the embedded default corpus). The file appears whole or not at all."""
    from baton.common.tokenizer import Tokenizer
    from baton.common.data import DataConfig, build_datasets

    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir} is not a checkpoint with a tokenizer (no tokenizer.json)")
    if samples < 1 or seq_len < 4 or temperature < 0:
        raise ValueError(f"need samples >= 1, seq_len >= 4 and temperature >= 0 (got {samples}, {seq_len}, {temperature})")
    tok = Tokenizer.from_dir(model_dir)
    train_ds, _ = build_datasets(DataConfig(path=data_path, seq_len=seq_len), tok)
    blocks = teacher_continuations(model_dir, train_ds, samples, seq_len + 1, temperature, seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        for row in blocks.tolist():
            f.write(json.dumps({"text": tok.decode(row)}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    log.info("wrote %d continuations by %s to %s", samples, model_dir, out)
    return out
