"""Shared pieces of the tensor/pipeline-parallel serving tests: references, launches, a workload
driver that adds requests between steps, and a spy on the block ops every rank must apply."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from baton.serve.engine import LLMEngine
from baton.serve.llm import LLM
from baton.serve.outputs import RequestOutput
from baton.serve.parallel.driver import DistributedRunner
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.block_manager import BlockOps

LAYOUTS = {"T2": (2, 1), "P2": (1, 2), "T2xP2": (2, 2)}


def hf_greedy(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' own greedy generation: the independent reference."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(gen[0, len(p) :].tolist())
    return out


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def sharded(path, config, layout: str) -> LLM:
    """An LLM over `layout`'s ranks (use as a context manager: the workers stop on exit)."""
    t, p = LAYOUTS[layout]
    return LLM(path, config, tensor_parallel_size=t, pipeline_parallel_size=p)


def check_really_sharded(engine: LLMEngine, layout: str, whole_model_bytes: int) -> DistributedRunner:
    """The engine runs on `layout`'s ranks, each holding less than the whole model (so a
    comparison with T=1 is not T=1 against itself), and its control plane was measured."""
    runner = engine.runner
    t, p = LAYOUTS[layout]
    assert isinstance(runner, DistributedRunner)
    assert (runner.topo.tp, runner.topo.pp, runner.topo.world) == (t, p, t * p)
    per_rank = runner.topo.stats["weight_bytes"]
    assert len(per_rank) == t * p and max(per_rank) < whole_model_bytes, per_rank
    assert runner.steps > 0
    assert 0 < runner.control_s < math.inf, runner.control_s
    return runner


@dataclass
class OpsSpy:
    """Counts the block ops the engine hands its runner (which the runner must broadcast)."""

    runner: object
    counts: dict[str, int] = field(default_factory=lambda: dict(swap_out=0, swap_in=0, copies=0, rerotations=0))

    def __post_init__(self) -> None:
        inner = self.runner.apply_block_ops

        def apply(ops: BlockOps) -> None:
            for k in self.counts:
                self.counts[k] += len(getattr(ops, k))
            inner(ops)

        self.runner.apply_block_ops = apply


@dataclass
class Arrival:
    step: int  # added before this engine step
    request_id: str
    prompt: str | list[int]
    params: SamplingParams


def drive(engine: LLMEngine, arrivals: list[Arrival], max_steps: int = 5000) -> dict[str, RequestOutput]:
    """Add each request before its step (between step() calls, as a server does), run to the end;
    the final output of every request."""
    pending = sorted(arrivals, key=lambda a: a.step)
    done: dict[str, RequestOutput] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.request_id, a.prompt, a.params)
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out
        step += 1
        assert step < max_steps, "the engine made no progress"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.host_free) == bm.num_host_blocks, "KV blocks leaked"
    return done


def tokens(outs: dict[str, RequestOutput]) -> dict[str, list[list[int]]]:
    return {rid: [c.token_ids for c in o.outputs] for rid, o in sorted(outs.items())}
