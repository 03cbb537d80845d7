"""Serving the Bamba hybrid (Mamba2 mixers + attention) with state slots beside the paged KV pool.

The yardstick is transformers' BambaForCausalLM.generate (fp32, its own cache and pure-torch
mixer path): the engine's greedy tokens equal it, and so do the log-probabilities of those tokens
(to 1e-4: a stale or misplaced state moves them by ~1e-2 even where the argmax survives), with
staggered arrivals in every state-handling mode - chunked prefill on and off, forced preemption
by recompute and by swap, prefix caching (hits asserted), n > 1 forks and n-gram speculation -
and the state pool is whole afterwards.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from baton.common.config import ConfigError
from baton.common.hf import import_hf
from baton.serve.core.faults import injector_from_spec
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.parallel.config import ParallelConfig
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

from .conftest import run_staggered_logprobs

# Four layers, mixers at 0 and 2, attention at 1 and 3; mamba chunk 8, so prompts span several chunks.
HF_KW = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attn_layer_indices=[1, 3],
    mamba_n_heads=4,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
LENGTHS = (3, 41, 17, 30, 9)
SHARED = 27  # the shared-prefix prompts: 27 common tokens (3 blocks of 8, and part of a fourth), then their own


def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and their log-probabilities."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [float(torch.log_softmax(x[0].float(), -1)[t]) for x, t in zip(out.logits, tokens)]
    return tokens, logprobs


def run_staggered(eng: LLMEngine, prompts, params=GREEDY, every: int = 2) -> list[tuple[list[int], list[float]]]:
    """One prompt every `every` steps while the others run; each one's (tokens, their logprobs)."""
    done = run_staggered_logprobs(eng, prompts, params, every)
    return [done[i] for i in range(len(prompts))]


def assert_matches(got, expected) -> None:
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and lose much to them on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    """(checkpoint, prompts, HF's greedy tokens for each): random HF weights, imported like a user would."""
    tmp = tmp_path_factory.mktemp("bamba-serve")
    torch.manual_seed(0)
    hf = transformers.BambaForCausalLM(transformers.BambaConfig(**HF_KW)).float().eval()
    with torch.no_grad():  # HF's init leaves A_log, D, dt_bias, norms and conv biases regular
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if not name.endswith("conv1d.bias") else p.normal_(0, 0.2)
            if name.endswith(("A_log", "dt_bias")):  # slow decay: the state remembers ~20 tokens, so a
                p.uniform_(-3, -1)  # wrong or stale state changes the tokens
    hf.save_pretrained(tmp / "hf")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in LENGTHS]
    prefix = torch.randint(0, 128, (SHARED,), generator=g).tolist()
    prompts += [prefix + torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 12)]
    prompts.append(([5, 9, 17, 33] * 8)[:30])  # repetitive: the n-gram proposer finds matches
    return import_hf(tmp / "hf", tmp / "baton"), prompts, [hf_greedy(hf, p) for p in prompts]


def engine(ckpt, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("block_size", 8)
    kw.setdefault("scheduler", SchedulerConfig(max_num_batched_tokens=16))
    return LLMEngine.from_checkpoint(ckpt, EngineConfig(**kw))


def assert_pool_whole(eng: LLMEngine) -> None:
    states, bm = eng.block_manager.states, eng.block_manager
    assert states.num_free == states.num_slots and not states.slot_of and not states.pending
    assert len(states.host_free) == states.num_host and not states.host_of
    assert states.problem([]) is None
    assert bm.num_free_blocks == bm.num_blocks


MODES = {
    "chunked-prefill": {},
    "no-chunked-prefill": dict(scheduler=SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=64)),
    "prefix-caching-off": dict(enable_prefix_caching=False),
    "preempt-recompute": dict(num_kv_blocks=9, scheduler=SchedulerConfig(max_num_batched_tokens=32)),
    "preempt-swap": dict(num_kv_blocks=9, scheduler=SchedulerConfig(max_num_batched_tokens=32, preemption_mode="swap")),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hf_with_staggered_arrivals(bamba, mode):
    ckpt, prompts, expected = bamba
    eng = engine(ckpt, **MODES[mode])
    states, swapped = eng.block_manager.states, []
    swap_out = states.swap_out
    states.swap_out = lambda seq: (swapped.append(seq.seq_id), swap_out(seq))
    assert_matches(run_staggered(eng, prompts), expected)
    if mode.startswith("preempt"):
        assert eng.scheduler.num_preemptions > 0
    assert bool(swapped) == (mode == "preempt-swap")  # states went to host slots and came back
    assert_pool_whole(eng)


def test_abort_and_failure_leave_the_pool_whole(bamba):
    """Aborted mid-prefill and mid-decode, and failed after a forward (the engine then recounts
    blocks and state slots, and would raise EngineFault if they did not add up)."""
    ckpt, prompts, expected = bamba
    eng = engine(ckpt)
    eng.fault_injector = injector_from_spec("postprocess:^bad$")
    for i, p in enumerate(prompts[:4]):
        eng.add_request(str(i), p, GREEDY)
    eng.add_request("bad", prompts[4], GREEDY)
    eng.step()  # "1" (41 tokens) is mid-prefill, "0" decodes
    eng.step()
    assert eng.block_manager.states.slot_of
    eng.abort_request("1")
    eng.abort_request("0")
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids if out.error is None else "failed"
    assert done == {"2": expected[2][0], "3": expected[3][0], "bad": "failed"}
    assert_pool_whole(eng)


def test_n_samples_fork_the_state(bamba):
    """Forks copy the parent's state: greedy samples all equal HF; seeded sample i equals a lone
    request seeded seed + i (which prefilled its own state)."""
    ckpt, prompts, expected = bamba
    eng = engine(ckpt)
    greedy3 = SamplingParams(n=3, temperature=0, max_tokens=NEW, ignore_eos=True)
    sampled = dict(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    eng.add_request("g", prompts[1], greedy3)
    eng.add_request("s", prompts[3], SamplingParams(n=3, seed=7, **sampled))
    for i in range(3):
        eng.add_request(f"alone{i}", prompts[3], SamplingParams(seed=7 + i, **sampled))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
    assert done["g"] == [expected[1][0]] * 3
    alone = [done[f"alone{i}"][0] for i in range(3)]
    assert sorted(done["s"]) == sorted(alone) and len({tuple(a) for a in alone}) > 1
    assert_pool_whole(eng)


def test_prefix_caching_restores_the_state(bamba):
    """A request whose prompt shares 3 cached blocks with an earlier one starts from the state
    snapshot where those blocks end; its tokens equal HF's (and the run with caching off)."""
    ckpt, prompts, expected = bamba
    eng = engine(ckpt, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    got = []
    for i in (5, 6, 5):  # one at a time: each later one finds the earlier blocks cached
        got += run_staggered(eng, [prompts[i]])
    assert_matches(got, [expected[5], expected[6], expected[5]])
    states = eng.block_manager.states
    assert eng.block_manager.prefix_hits >= 2 * 24 and states.snapshot_hits >= 2
    assert_pool_whole(eng)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_rolls_the_state_back(bamba, tmp_path, method):
    """Verification leaves each slot at the state of the last accepted token: greedy output equals
    HF's with proposals accepted and rejected (a random Llama draft: rejected almost always)."""
    ckpt, prompts, expected = bamba
    if method == "ngram":
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_max=3)
    else:
        kw = {k: HF_KW[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")}
        draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, num_hidden_layers=1)).eval()
        draft.save_pretrained(tmp_path / "hf-draft")
        spec = SpeculativeConfig("draft", 3, draft_model=str(import_hf(tmp_path / "hf-draft", tmp_path / "draft")))
    eng = engine(ckpt, speculative=spec)
    assert_matches(run_staggered(eng, prompts), expected)
    stats = eng.speculative.stats
    assert stats.accepted < stats.proposed and (stats.accepted > 0 or method == "draft")
    assert_pool_whole(eng)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(parallel=ParallelConfig(tensor_parallel_size=2)), "tensor/pipeline parallel"),
        (dict(speculative=SpeculativeConfig(method="lookahead")), "checkpoints a chain only"),
        (dict(streaming_window_tokens=32), "StreamingLLM"),
        (dict(early_exit_threshold=0.9), "early exit"),
        (dict(num_kv_blocks=None, kv_cache_bytes=100_000), "recurrent-state slots"),
    ],
)
def test_refused_at_start_up_with_the_reason(bamba, kw, words):
    with pytest.raises(ConfigError, match=words):
        engine(bamba[0], **kw)


def test_state_slots_are_counted_against_the_kv_budget(bamba):
    """One budget: running slots (max_num_seqs), then snapshots (a quarter at most), the rest blocks."""
    from baton.serve.engine.sizing import state_slot_bytes
    from baton.serve.runner.model_runner import kv_block_bytes

    budget = 1_000_000
    eng = engine(bamba[0], num_kv_blocks=None, kv_cache_bytes=budget, scheduler=SchedulerConfig(max_num_seqs=8))
    states, model = eng.block_manager.states, eng.runner.model
    slot, block = state_slot_bytes(model.config, torch.float32), kv_block_bytes(model, 8, torch.float32)
    assert block == 2 * 2 * 8 * 2 * 8 * 4  # K and V, the 2 attention layers only, 8 tokens of 2 heads x 8
    assert states.num_slots == 8 and 0 < states.num_snapshots * slot <= budget // 4
    used = (states.num_slots + states.num_snapshots) * slot + eng.block_manager.num_blocks * block
    assert budget - block < used <= budget
    assert eng.runner.state_pool.slots[0].ssm.shape[0] == states.num_slots + states.num_snapshots


def test_snapshots_are_bounded_and_evicted_with_their_blocks():
    """A snapshot lives as long as the cached block where its prefix ends, and the pool of them is bounded."""
    from baton.serve.core.sequence import Sequence
    from baton.serve.scheduling.block_manager import BlockManager
    from baton.serve.scheduling.state_slots import StateSlots

    states = StateSlots(num_slots=2, num_snapshots=3)
    bm = BlockManager(4, 4, True, 0, states)

    def run(seq_id: int, tokens: list[int]) -> Sequence:
        seq = Sequence(seq_id, str(seq_id), 0, tokens, GREEDY)
        seq.num_computed_tokens = bm.match_prefix(seq)
        assert bm.allocate_slots(seq, len(tokens) - seq.num_computed_tokens)
        seq.num_computed_tokens = len(tokens)  # the forward ran
        bm.register_full_blocks(seq)
        bm.free(seq)
        return seq

    a = run(0, list(range(9)))  # snapshots at 8 (where the same prompt's hit ends)
    assert list(states.snapshots) == [a.block_hashes[1]]
    again = Sequence(1, "1", 0, list(range(9)), GREEDY)
    assert bm.match_prefix(again) == 8 and states.restore == {1: states.num_slots}
    bm.free(again)
    b = run(2, list(range(100, 113)))  # 4 blocks: a's cached blocks are evicted, and its snapshot with them
    assert list(states.snapshots) == [b.block_hashes[2]]  # (free snapshot slots were left: not LRU)
    assert states.problem([]) is None
    states = StateSlots(num_slots=2, num_snapshots=3)
    bm = BlockManager(64, 4, True, 0, states)  # room for every block: only the bound evicts snapshots
    last = [run(i, [i] * 9).block_hashes[1] for i in range(3, 8)]  # more prompts than snapshot slots
    assert list(states.snapshots) == last[-3:]  # the least recently used went
    assert states.problem([]) is None and states.num_free == 2
