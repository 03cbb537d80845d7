"""KV groups: a model that mixes sliding-window and full layers keeps two KV groups, and its sliding
layers free the blocks that fall out of the window (serve/scheduling/window_blocks.py).

A random-weight Gemma 3 written by transformers, five sliding layers to one full as the real one,
with a window of 8 tokens and blocks of 4, runs prompts of up to 130 tokens for 20 more: greedy
tokens equal transformers' generate with prefix-cache hits, chunked prefill, forced preemption (by
recompute and by swap) and speculative decoding; seeded n > 1 samples (forks, copy-on-write) and
their logprobs equal the one-group engine's exactly. A long sequence's sliding-group blocks stay at
its window's (counted from the block manager) while its full-group blocks grow; every block of
both groups is back in its pool at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from baton.common.checkpoint import read_config
from baton.common.hf import import_hf
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.engine.sizing import kv_group_window
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.block_manager import BlockManager
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.scheduling.window_blocks import NULL_BLOCK, WindowBlocks, window_blocks_bound
from baton.serve.speculative import SpeculativeConfig

from .conftest import run_staggered
from .test_families import BASE

WINDOW, BS, MAX_TOKENS = 8, 4, 20
GEMMA3 = dict(
    num_hidden_layers=6,
    num_key_value_heads=1,
    head_dim=16,
    sliding_window=WINDOW,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    query_pre_attn_scalar=24,
    final_logit_softcapping=5.0,
)


def config(num_kv_blocks=128, budget=64, mode="recompute", **kw) -> EngineConfig:
    sched = SchedulerConfig(max_num_batched_tokens=budget, preemption_mode=mode)
    return EngineConfig(num_kv_blocks=num_kv_blocks, block_size=BS, scheduler=sched, **kw)


MODES = {
    "prefix-cache": config(),
    "tiny-chunks": config(budget=12),
    "preempt-recompute": config(num_kv_blocks=48, budget=32),
    "preempt-swap": config(num_kv_blocks=48, budget=32, mode="swap"),
    "ngram": config(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1)),
    "lookahead": config(speculative=SpeculativeConfig(method="lookahead")),
}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, BASE["vocab_size"], (40,), generator=g).tolist()
    own = [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in (3, 37, 90)]
    return own + [shared + p for p in own]


def make_gemma3(tmp: Path):
    """(transformers model, Baton checkpoint) of the Gemma 3 above (tests/serve/parallel serve it sharded)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Gemma3TextConfig(**{**BASE, **GEMMA3}))
    hf = hf.float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:  # the norms off their initial values, as test_families does
                p.add_(torch.randn_like(p) * 0.2)
        # Gemma scales the embedding by sqrt(hidden): a smaller one gives greedy runs that do not repeat a token
        hf.model.embed_tokens.weight.mul_(0.25)
    hf.save_pretrained(tmp / "hf")
    return hf, import_hf(tmp / "hf", tmp / "baton")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(Baton checkpoint, transformers' greedy continuations of prompts())."""
    hf, ckpt = make_gemma3(tmp_path_factory.mktemp("gemma3-kv-groups"))
    expected = []
    for p in prompts():
        ids = torch.tensor([p])
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        expected.append(out[0, len(p) :].tolist())
    return ckpt, expected


def assert_all_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.host_free) == bm.num_host_blocks
    w = bm.window
    assert w.num_free_blocks == w.num_blocks and len(w.pool.host_free) == w.num_host_blocks
    assert bm.problem([]) is None


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_equals_transformers_with_two_kv_groups(gemma3, mode):
    ckpt, expected = gemma3
    engine = LLMEngine.from_checkpoint(ckpt, MODES[mode])
    w = engine.block_manager.window
    assert w is not None and w.window == WINDOW
    runner = engine.runner
    assert runner.window_layers == [0, 1, 2, 3, 4] and runner.full_layers == [5]
    assert runner.kv_caches[0][0].shape[0] == w.num_blocks and runner.kv_caches[5][0].shape[0] == runner.num_blocks
    got = run_staggered(engine, prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert got == expected, mode
    assert len({tuple(t) for t in got}) == len(got) and all(len(set(t)) > 2 for t in got), "degenerate outputs"
    assert w.num_dropped > 0, "the window's old blocks were meant to be freed"
    assert_all_free(engine)
    if mode.startswith("preempt"):
        assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    if mode == "prefix-cache":
        assert engine.block_manager.prefix_hits > 0, "the shared 40-token prefix was meant to be found in the cache"
    if engine.speculative is not None:
        assert engine.speculative.stats.proposed > 0


@pytest.mark.parametrize("mode", ["prefix-cache", "preempt-swap", "lookahead"])
def test_seeded_forks_equal_the_one_group_engine(gemma3, mode):
    """n = 3 seeded samples share the prompt's blocks of both groups and copy on write: tokens and
    logprobs equal the one-group engine's exactly. (Not with prefix caching under lookahead: the
    sliding group only caches a shared prefix's blocks that left the window, where the one group
    holds them, so a hit can differ, and with it the order of the forks' ids, which seed the
    lookahead's Jacobi start.)"""
    ckpt, _ = gemma3
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = []
    for groups in (True, False):
        cfg = {**MODES[mode].__dict__, "kv_cache_groups": groups}
        if mode == "lookahead":
            cfg["enable_prefix_caching"] = False
        engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(**cfg))
        assert (engine.block_manager.window is not None) == groups
        done = {}
        for i, p in enumerate(prompts()):
            engine.add_request(str(i), p, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = [(o.token_ids, o.logprobs) for o in out.outputs]
        if groups:
            assert_all_free(engine)
        outs.append(done)
    assert outs[0] == outs[1]


def test_sliding_group_holds_the_window_while_full_group_grows(gemma3):
    """Gemma 3's window layers free out-of-window blocks: counted after every step of one long
    sequence, the sliding group holds at most its window's blocks, the full group every token's."""
    ckpt, _ = gemma3
    engine = LLMEngine.from_checkpoint(ckpt, config(budget=16))
    bm, w = engine.block_manager, engine.block_manager.window
    prompt = prompts()[-1]  # 130 tokens, prefilled in chunks of 16
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    decode_bound, chunk_bound = window_blocks_bound(WINDOW, BS, 1), window_blocks_bound(WINDOW, BS, 16)
    counts = []
    while engine.has_unfinished_requests():
        engine.step()
        if seq.is_finished:
            break
        held, full = len(w.held(seq)), len(seq.block_table)
        assert full == -(-seq.num_computed_tokens // BS)
        assert held <= (decode_bound if seq.num_computed_tokens >= len(prompt) else chunk_bound)
        assert bm.num_blocks - bm.num_free_blocks == full and w.num_blocks - w.num_free_blocks == held
        stats = engine.stats()  # (what /metrics reports as baton_kv_blocks and baton_kv_window_blocks)
        assert stats.kv_blocks_total - stats.kv_blocks_free == full
        assert stats.kv_window_blocks_total - stats.kv_window_blocks_free == held
        assert seq.window_block_table[: seq.num_window_dropped] == [NULL_BLOCK] * seq.num_window_dropped
        counts.append((held, full))
    assert counts[-1][1] >= (len(prompt) + 58) // BS, "the full group keeps every token"
    assert max(h for h, _ in counts[len(counts) // 2 :]) <= decode_bound == 3
    assert w.num_dropped >= counts[-1][1] - decode_bound
    assert_all_free(engine)


def test_a_prefix_hit_needs_the_window_blocks_too():
    """Both groups register under the same hashes; a hit is cut back to where the sliding group
    still has the blocks its first new token sees (freed blocks stay findable until evicted)."""

    def seq(i: int, tokens: list[int]) -> Sequence:
        return Sequence(i, str(i), 0, tokens, SamplingParams())

    def computed_then_freed() -> BlockManager:
        bm = BlockManager(64, BS, True, window=WindowBlocks(12, BS, WINDOW))
        a = seq(0, list(range(40)))
        assert bm.allocate_slots(a, 40)
        a.num_computed_tokens = 40
        bm.register_full_blocks(a)
        bm.free(a)  # every block of both groups free, and cached; the tail freed first
        return bm

    bm = computed_then_freed()
    b = seq(1, list(range(50)))
    assert bm.match_prefix(b) == 40  # blocks 0-9; the window of token 40 (33..40) starts in block 8
    assert b.num_window_dropped == 8 and len(bm.window.held(b)) == 2 and len(b.block_table) == 10
    assert b.window_block_table[:8] == [NULL_BLOCK] * 8

    # a's sliding blocks were freed as they left the window (0-7, at its last step) and at its end
    # (9, 8): a hit of blocks 0-4 holds 3 and 4 again, so they are freed last of all
    bm = computed_then_freed()
    b = seq(1, list(range(20)) + [300] * 10)
    assert bm.match_prefix(b) == 20 and b.num_window_dropped == 3 and len(bm.window.held(b)) == 2
    bm.free(b)
    c = seq(2, [299] * 40)  # takes the two never-used sliding blocks, then all of a's but 3 and 4
    assert bm.allocate_slots(c, 40)
    d = seq(3, list(range(50)))
    assert bm.match_prefix(d) == 20  # the full group has ten blocks; 20 is the longest hit with its window
    assert d.num_window_dropped == 3 and len(bm.window.held(d)) == 2 and len(d.block_table) == 5
    assert bm.problem([c, d]) is None
    for s in (c, d):
        bm.free(s)
    assert bm.window.num_free_blocks == 12 and bm.num_free_blocks == 64 and bm.problem([]) is None


def test_groups_only_where_the_model_mixes_layer_kinds(gemma3, tmp_path):
    ckpt, _ = gemma3
    mcfg = read_config(ckpt)
    assert kv_group_window(EngineConfig(), mcfg) == WINDOW
    assert kv_group_window(EngineConfig(kv_cache_groups=False), mcfg) is None
    assert kv_group_window(EngineConfig(streaming_window_tokens=64), mcfg) is None
    mcfg.layer_types = ["sliding_attention"] * 6  # all sliding (Mistral): SlidingWindowPolicy's
    assert kv_group_window(EngineConfig(), mcfg) is None
    mcfg.layer_types = ["full_attention"] * 6
    assert kv_group_window(EngineConfig(), mcfg) is None


def test_a_byte_budget_gives_the_sliding_group_what_the_batch_can_use(gemma3):
    """The sliding layers' pool: max_num_seqs windows (a partial block at both ends) and one step's
    tokens; the full layers' pool the rest of the budget."""
    ckpt, _ = gemma3
    budget = 4 * 2**20
    cfg = EngineConfig(block_size=BS, kv_cache_bytes=budget, scheduler=SchedulerConfig(max_num_seqs=3))
    runner = LLMEngine.from_checkpoint(ckpt, cfg).runner

    def block_bytes(layers: list[int]) -> int:
        return (
            sum(k.nbytes + v.nbytes for k, v in (runner.kv_caches[i] for i in layers))
            // runner.kv_caches[layers[0]][0].shape[0]
        )

    full, sliding = block_bytes(runner.full_layers), block_bytes(runner.window_layers)
    assert sliding == 5 * full
    demand = 3 * (-(-(WINDOW - 1) // BS) + 2) + 512 // BS
    assert runner.num_window_blocks == demand
    assert runner.num_blocks == (budget - demand * sliding) // full
