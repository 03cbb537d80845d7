"""The offline API: LLM(model_dir).generate(prompts, SamplingParams(...)), as in vLLM."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from tqdm.auto import tqdm

from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.outputs import RequestOutput
from baton.serve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path, config: EngineConfig | None = None, device: str = "cpu",
                 dtype: torch.dtype | None = None):
        self.engine = LLMEngine.from_checkpoint(model, config, device=device, dtype=dtype)
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (all validated before any is scheduled); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        for prompt, p in zip(prompts, params_list):
            self.engine.validate_request(prompt, p)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.engine.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in ids]
