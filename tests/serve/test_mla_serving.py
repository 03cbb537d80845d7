"""DeepSeek-V3 served from a latent-only paged cache: greedy tokens equal transformers' generate.

Two random-weight DeepseekV3ForCausalLM checkpoints written by transformers itself (fp32, every 1-D
weight moved off its initial value): one with the q LoRA and DeepSeekMoE (a dense first layer, then
grouped routing over 8 experts with a shared expert and a score-correction bias), one without the q
LoRA (DeepSeek-V2-Lite's single q_proj), dense, with odd widths (v_head_dim != qk_nope_head_dim) and
YaRN. Each runs through chunked prefill with prefix caching, and preemption by recompute and by
swap, with one engine per mode shared by the checks on it. The cache holds exactly kv_lora_rank +
qk_rope_head_dim values a token a layer (one pool tensor per layer, asserted from its bytes and from
the engine's sizing). The absorbed form equals the naive one (kv_b_proj decompressing the cached
latents, the same engine otherwise) step by step in logits; long prefill chunks, which the backend
attends decompressed, give transformers' tokens, and so do speculative chains (n-gram), token trees
(lookahead) and LayerSkip's self-draft; what the latent cache cannot do is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from baton.common.checkpoint import read_config
from baton.common.config import ConfigError
from baton.common.hf import import_hf
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.runner.mla_attention import LatentPagedAttention
from baton.serve.runner.model_runner import kv_block_bytes
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig

from .conftest import run_staggered

VOCAB = 301
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    initializer_range=0.1,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
CONFIGS = {
    "q_lora-moe": dict(
        num_hidden_layers=3,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
    ),
    "no_q_lora-yarn": dict(
        num_hidden_layers=2,
        q_lora_rank=None,
        qk_nope_head_dim=12,
        v_head_dim=20,
        first_k_dense_replace=2,  # dense: no layer reaches the experts
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale_all_dim": 1.0,
        },
    ),
}
MODES = {
    "chunked-prefix": EngineConfig(
        num_kv_blocks=96, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=12)
    ),
    "preempt-recompute": EngineConfig(
        num_kv_blocks=18,
        block_size=8,
        scheduler=SchedulerConfig(max_num_batched_tokens=32, preemption_mode="recompute"),
    ),
    "preempt-swap": EngineConfig(
        num_kv_blocks=18, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=32, preemption_mode="swap")
    ),
}
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_deepseek_checkpoint(tmp_path, name: str, seed: int = 0):
    """(transformers model, Baton checkpoint): random weights, norms and the routing bias moved."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**{**BASE, **CONFIGS[name]})
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    hf.save_pretrained(tmp_path / f"hf-{name}")
    return hf, import_hf(tmp_path / f"hf-{name}", tmp_path / f"baton-{name}")


def prompts() -> list[list[int]]:
    """Four prompts of their own and three sharing a 40-token prefix (five blocks of 8)."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    own = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 29, 11, 50)]
    return own + [shared + p for p in own[:3]]


def hf_greedy(hf, ps: list[list[int]]) -> list[list[int]]:
    out = []
    for p in ps:
        ids = torch.tensor([p])
        gen = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def deepseek(request, tmp_path_factory):
    hf, ckpt = make_deepseek_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, hf, ckpt, hf_greedy(hf, prompts())


@pytest.fixture(scope="module", params=sorted(MODES))
def served(request, deepseek):
    """(config name, mode, engine after the workload, its tokens, transformers' tokens)."""
    name, _, ckpt, expected = deepseek
    engine = LLMEngine.from_checkpoint(ckpt, MODES[request.param])
    got = run_staggered(engine, prompts(), GREEDY)
    return name, request.param, engine, got, expected


def test_greedy_equals_transformers(served):
    name, mode, engine, got, expected = served
    runner = engine.runner
    assert isinstance(runner.attn, LatentPagedAttention) and runner.answer_sampled_rows
    assert runner.cpu_layers is None, "the C++ layer stack is Llama's dataflow: MLA layers run as modules"
    assert got == expected, f"{name} in {mode}"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.host_free) == bm.num_host_blocks
    if mode.startswith("preempt"):
        assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    if mode == "chunked-prefix":
        assert bm.prefix_hits >= 40, "a later sharer should find the 40-token prefix cached"


def test_the_cache_holds_the_latent_and_rope_key_only(served):
    """One pool per layer of kv_lora_rank + qk_rope_head_dim values a token: from the tensors and the sizing."""
    _, mode, engine, _, _ = served
    runner, cfg = engine.runner, engine.model_config
    per_token = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    bs, layers = runner.block_size, cfg.num_hidden_layers
    assert all(len(p) == 1 for p in runner.kv_caches)
    for pool in [p[0] for p in runner.kv_caches] + [p[0] for p in runner.host_caches]:
        assert pool.shape[1:] == (bs, per_token) and pool.dtype == torch.float32
    pool_bytes = sum(p[0].numel() * p[0].element_size() for p in runner.kv_caches)
    assert pool_bytes == runner.num_blocks * bs * layers * per_token * 4
    assert kv_block_bytes(runner.model, bs, torch.float32) == layers * bs * per_token * 4
    if mode == "preempt-swap":  # the host pool is sized in latent blocks too
        assert runner.num_host_blocks == engine.config.swap_space_bytes // (layers * bs * per_token * 4)


def test_sized_from_a_byte_budget_in_latent_blocks(deepseek):
    _, _, ckpt, _ = deepseek
    cfg = EngineConfig(block_size=8, kv_cache_bytes=1 << 20)
    engine = LLMEngine.from_checkpoint(ckpt, cfg)
    m = engine.model_config
    block = m.num_hidden_layers * 8 * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    assert engine.block_manager.num_blocks == (1 << 20) // block


def _logged_logits(ckpt, form: str) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every step's logits of the chunked-prefix workload with the backend in `form`."""
    engine = LLMEngine.from_checkpoint(ckpt, MODES["chunked-prefix"])
    engine.runner.attn.form = form
    logits, execute = [], engine.runner.execute

    def logged(*args):
        result = execute(*args)
        logits.append(result.logits.clone())
        return result

    engine.runner.execute = logged
    return logits, run_staggered(engine, prompts(), GREEDY)


def test_absorbed_equals_the_naive_form(deepseek):
    """The same engine with the backend decompressing the cached latents through kv_b_proj."""
    name, _, ckpt, expected = deepseek
    absorbed, got = _logged_logits(ckpt, "absorbed")
    naive, got_naive = _logged_logits(ckpt, "decompress")
    assert got == got_naive == expected
    assert len(absorbed) == len(naive)
    for a, b in zip(absorbed, naive):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


SPECULATIVE = {
    "ngram": SpeculativeConfig("ngram", 3),
    "lookahead": SpeculativeConfig("lookahead"),
    "layerskip": SpeculativeConfig("layerskip", 3, exit_layer=1),
}


@pytest.mark.parametrize("deepseek", ["q_lora-moe"], indirect=True)
@pytest.mark.parametrize("spec", sorted(SPECULATIVE))
def test_speculative_chains_and_trees(deepseek, spec):
    """Chains verify as short chunks' rows, lookahead's trees through the tree mask, and LayerSkip's
    draft writes the latents of the layers below its exit at the real slots (late entry): greedy unchanged."""
    _, _, ckpt, expected = deepseek
    sc = SPECULATIVE[spec]
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=96, block_size=8, speculative=sc))
    assert run_staggered(engine, prompts(), GREEDY) == expected
    assert engine.stats().spec_proposed_tokens > 0


@pytest.mark.parametrize("deepseek", ["q_lora-moe"], indirect=True)
def test_long_chunks_attend_decompressed(deepseek):
    """A 300-token prompt's chunk and a 260-token chunk after a 200-token prefix hit (beside the first
    sequence's decode row) take the decompressed prefill path; the tokens stay transformers'."""
    _, hf, ckpt, _ = deepseek
    g = torch.Generator().manual_seed(3)
    first = torch.randint(0, VOCAB, (300,), generator=g).tolist()
    ps = [first, first[:200] + torch.randint(0, VOCAB, (260,), generator=g).tolist()]
    engine = LLMEngine.from_checkpoint(
        ckpt, EngineConfig(num_kv_blocks=96, block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=512))
    )
    attn, chunks = engine.runner.attn, []
    prefill = attn._prefill

    def spy(*args):
        chunks.append((args[6].diff().tolist(), args[7].tolist()))  # (chunk sizes, their cached prefixes)
        return prefill(*args)

    attn._prefill = spy
    assert run_staggered(engine, ps, GREEDY) == hf_greedy(hf, ps)
    assert ([300], [0]) in chunks and ([260], [200]) in chunks, chunks


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(streaming_window_tokens=64), "StreamingLLM"),
        (dict(kv_cache_dtype="int8"), "quantized KV cache"),
        (dict(early_exit_threshold=0.9), "early exit"),
    ],
)
def test_what_the_latent_cache_cannot_do_is_refused(deepseek, change, words):
    _, _, ckpt, _ = deepseek
    cfg = dataclasses.replace(EngineConfig(num_kv_blocks=16, block_size=8), **change)
    with pytest.raises(ConfigError, match=f"multi-head latent attention.*{words}"):
        LLMEngine.from_checkpoint(ckpt, cfg)


def test_routers_and_layouts_size_mla_by_its_latent_row(deepseek):
    """The CoE router's KV estimate and the parallel layout check read MLA's own widths."""
    from baton.serve.coe.config import kv_bytes_per_token
    from baton.serve.parallel.config import ParallelConfig

    _, _, ckpt, _ = deepseek
    m = read_config(ckpt)
    assert kv_bytes_per_token(ckpt) == m.num_hidden_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    # o_proj's input is heads * v_head_dim (head_dim is MLA's rope width): the int4 check names that width
    width = m.num_attention_heads * m.v_head_dim
    with pytest.raises(ValueError, match=rf"attention output input \({width}\) split 2 ways"):
        ParallelConfig(tensor_parallel_size=2).check_model(m, group_size=width)
