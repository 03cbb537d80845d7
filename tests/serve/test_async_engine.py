"""The async engine: concurrent streams equal offline outputs; cancelling frees the KV cache."""

from __future__ import annotations

import asyncio

import pytest
import torch

from baton.common.checkpoint import load_checkpoint
from baton.common.model import greedy_generate
from baton.serve.async_engine import AsyncLLMEngine
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams

from .conftest import make_hf_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("async"), "llama")[1]


def test_concurrent_streams_and_cancellation(ckpt):
    model = load_checkpoint(ckpt).model
    prompts = [list(range(i, i + 5 + 7 * i)) for i in range(8)]
    expected = [greedy_generate(model, torch.tensor([p]), 20)[0].tolist() for p in prompts]
    engine = AsyncLLMEngine(LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=96, block_size=8)))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def consume(i):
        tokens = []
        async for out in engine.generate(prompts[i], params, f"r{i}"):
            tokens += out.outputs[0].delta_token_ids
            if i % 3 == 0 and len(tokens) >= 5:
                return None  # the client walks away mid-stream
        return tokens

    async def main():
        return await asyncio.gather(*(consume(i) for i in range(8)))

    try:
        results = asyncio.run(main())
        for i, got in enumerate(results):
            if i % 3 == 0:
                assert got is None
            else:
                assert got == expected[i], i
        bm = engine.engine.block_manager
        assert engine.snapshot(lambda e: (e.has_unfinished_requests(), bm.num_free_blocks)) == (False, bm.num_blocks)

        async def bad():
            async for _ in engine.generate([], params, "bad"):
                pass

        with pytest.raises(ValueError, match="prompt is empty"):
            asyncio.run(bad())
        assert asyncio.run(main())[1] == expected[1], "the engine keeps serving after bad input"
    finally:
        engine.shutdown()
