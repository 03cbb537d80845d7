"""The offline API: LLM(model_dir).generate(prompts, SamplingParams(...)) and .chat(messages), as in vLLM.

A prompt is text, a list of token ids, or vLLM's TokensPrompt {"prompt_token_ids": [...]}. Chat
renders OpenAI-style messages with the checkpoint's chat_template (serve/openai/chat.py), the same
rendering the HTTP server's /v1/chat/completions uses, so offline and served chat prompts agree.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import torch
from tqdm.auto import tqdm

from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.outputs import RequestOutput
from baton.serve.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, list[int]]


def prompt_of(prompt: Prompt) -> str | list[int]:
    """Text or token ids; a dict must be vLLM's TokensPrompt (other vLLM prompt kinds are not supported)."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) != {"prompt_token_ids"}:
        raise ValueError(
            f"a prompt dict takes exactly one key, 'prompt_token_ids' (vLLM's TokensPrompt); "
            f"got {sorted(prompt)}: pass text as a str"
        )
    return list(prompt["prompt_token_ids"])


class LLM:
    def __init__(
        self,
        model: str | Path,
        config: EngineConfig | None = None,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        tensor_parallel_size: int | None = None,
        pipeline_parallel_size: int | None = None,
    ):
        """`tensor_parallel_size` / `pipeline_parallel_size` (vLLM's names) set config.parallel:
        the model is sharded over that many worker processes, spawned here."""
        config = config or EngineConfig()
        if tensor_parallel_size is not None or pipeline_parallel_size is not None:
            par = config.parallel
            config = dataclasses.replace(
                config,
                parallel=dataclasses.replace(
                    par,
                    tensor_parallel_size=tensor_parallel_size or par.tensor_parallel_size,
                    pipeline_parallel_size=pipeline_parallel_size or par.pipeline_parallel_size,
                ),
            )
        self.engine = LLMEngine.from_checkpoint(model, config, device=device, dtype=dtype)
        self.model_dir = str(model)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the worker processes of a sharded model (also done at interpreter exit)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (all validated before any is scheduled); outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = [prompt_of(p) for p in prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        for prompt, p in zip(prompts, params_list):
            self.engine.validate_request(prompt, p)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.engine.add_request(rid, prompt, p, final_only=True)  # it reads finished outputs only
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"}) or a list of them, each
        rendered with the checkpoint's chat_template; ValueError if it has none."""
        from baton.serve.openai.chat import render

        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer: this checkpoint has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.engine.tokenizer.encode(render(self.model_dir, conv, add_generation_prompt)) for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)
