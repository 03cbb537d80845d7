"""`--speculative mtp`: DeepSeek-V3's MTP modules draft, the target verifies. Greedy output equals
plain decoding token for token (random modules, which the target mostly rejects, and a briefly
trained one, whose drafts it accepts), sampled output keeps the target's distribution, each draft
equals the one the modules compute densely over the same rows (naive MLA, no caches), and a
checkpoint without MTP weights is refused before any work starts."""

from __future__ import annotations

import json

import pytest
import torch
from baton.common.checkpoint import load_state_dict, save_model
from baton.common.config import ConfigError, ModelConfig
from baton.common.model import DenseCausalAttention, build_model, greedy_generate
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpeculativeConfig
from baton.serve.speculative.registry import check_checkpoint
from safetensors.torch import save_file

from .conftest import run_staggered

# A tiny DeepSeek-V3: MLA with a low-rank query and odd head dims, a dense first layer, then
# DeepSeekMoE (8 routed experts in 2 groups, a shared one); its MTP blocks are MoE layers too.
CFG = dict(
    model_type="deepseek_v3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    initializer_range=0.1,
    max_position_embeddings=256,
)
PROMPT_LENGTHS = (4, 37, 11, 60, 18)
MAX_TOKENS = 24


def target(num_mtp: int, seed: int = 0, **over):
    """Random weights, the main model's the same whatever num_mtp (drawn first). Norm weights are
    drawn too: at 1, a module's recycled state would not tell norm_output(h) from h (the next
    depth's hnorm undoes an all-ones norm)."""
    model = build_model(ModelConfig(**{**CFG, **over, "num_nextn_predict_layers": num_mtp}), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model.eval()


def _prompts():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    return prompts + [[7, 8, 9, 10, 11] * 8]


def plain(model, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Plain greedy decoding of every prompt: the dense model, no cache."""
    return [greedy_generate(model, torch.tensor([p]), max_tokens)[0].tolist() for p in _prompts()]


def train_mtp(model, continuations: list[list[int]], steps: int = 30):
    """The MTP module briefly trained (the target frozen) on the target's own greedy continuations
    of the prompts, each row from the prompt's last token on as the served module sees it (the
    engine hands over hidden states from there): it learns to predict the token after next there."""
    rows = [p[-1:] + c for p, c in zip(_prompts(), continuations)]
    starts = [len(p) - 1 for p in _prompts()]
    with torch.no_grad():
        hidden = torch.cat(
            [model.hidden(torch.tensor([p + c]))[:, s:] for p, c, s in zip(_prompts(), continuations, starts)]
        )
    ids = torch.tensor(rows)
    positions = torch.stack([torch.arange(s, s + ids.shape[1]) for s in starts])
    opt = torch.optim.AdamW(model.mtp.parameters(), lr=1e-2)
    for _ in range(steps):
        (logits,) = model.mtp_logits(ids, hidden, positions)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Checkpoints by name - one target (the same main weights: `target` draws them first) with one
    random module, two random modules, one trained module, none - and its plain greedy outputs."""
    d = tmp_path_factory.mktemp("mtp")
    made = {"one": target(1), "two": target(2), "trained": target(1)}
    expected = plain(made["one"])
    train_mtp(made["trained"], expected)
    for name, model in made.items():
        save_model(d / name, model)
    save_model(d / "none", target(0))
    return d, made, expected


# name -> (checkpoint, k): "two" drafts 4 deep with 2 modules (module 1 at depth 1, then recurring)
MODES = {"one": ("one", 3), "two": ("two", 4), "trained": ("trained", 3)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("pressure", ["roomy", "preempting"])
def test_greedy_identical_to_plain_decoding(models, mode, pressure):
    d, _, expected = models
    ckpt, k = MODES[mode]
    spec = SpeculativeConfig("mtp", k)
    cfg = EngineConfig(num_kv_blocks=96, block_size=8, speculative=spec)
    if pressure == "preempting":
        sched = SchedulerConfig(max_num_batched_tokens=24, preemption_mode="swap")
        cfg = EngineConfig(num_kv_blocks=22, block_size=8, speculative=spec, scheduler=sched)
    engine = LLMEngine.from_checkpoint(d / ckpt, cfg)
    got = run_staggered(
        engine, _prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), every=2
    )
    assert got == expected
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.host_free) == bm.num_host_blocks
    stats, info = engine.speculative.stats, engine.stats()
    assert stats.proposed > 0 and len(stats.proposed_by_depth) == k
    assert info.spec_method == "mtp" and info.spec_acceptance_rate == stats.acceptance_rate
    assert info.spec_mean_accepted_length == stats.mean_accepted_length
    if mode == "trained":  # accepted drafts, 2 deep too: the equality above covers accepted tokens
        assert all(a > 0 for a in stats.accepted_by_depth[:2]), stats
        assert stats.acceptance_rate > 0.3, stats
    if pressure == "preempting":
        assert engine.scheduler.num_preemptions > 0
    assert not engine.speculative.proposer.states  # every finished sequence's MTP cache was dropped


@torch.no_grad()
def dense_drafts(model, tokens: list[int], start: int, k: int) -> list[torch.Tensor]:
    """The logits of each draft depth, computed densely (DenseCausalAttention: naive MLA, no
    cache) over the rows the proposer's modules hold: module 0 over the target's hidden states at
    positions start..T-2 (start: the prompt's last token, the first state the engine hands over),
    module m over module m - 1's normed outputs at start..T-2-m, then one draft row at T - 2 (depth
    m), and the last module recurring one position further per depth. Drafts are the argmax."""
    n, t = len(model.mtp), len(tokens)

    def run(m, rows):
        h, toks, pos = rows
        attn = DenseCausalAttention()
        out = model.mtp[m](
            h[None], torch.tensor([toks]), torch.tensor([pos]), attn, model.model.embed, model.model.inv_freq
        )
        return out[0]

    hid = model.hidden(torch.tensor([tokens]))[0]
    rows = (hid[start : t - 1], tokens[start + 1 : t], list(range(start, t - 1)))
    real = run(0, rows)
    last = real[-1]
    logits = [model.mtp[0].logits(last, model.lm_head)]
    for depth in range(1, k):
        m, draft = min(depth, n - 1), int(logits[-1].argmax())
        if depth < n:
            r = max(0, t - 1 - m - start)
            h = torch.cat([model.mtp[m - 1].norm_output(real[:r]), model.mtp[m - 1].norm_output(last)[None]])
            rows = (h, tokens[start + m + 1 : start + m + 1 + r] + [draft], list(range(start, start + r)) + [t - 2])
            out = run(m, rows)
            real, last = out[:r], out[-1]
        else:
            h = torch.cat([rows[0], model.mtp[n - 1].norm_output(last)[None]])
            rows = (h, rows[1] + [draft], rows[2] + [rows[2][-1] + 1])
            last = run(n - 1, rows)[-1]
        logits.append(model.mtp[m].logits(last, model.lm_head))
    return logits


@pytest.mark.parametrize("mode", ["one", "two"])
def test_drafts_equal_the_dense_modules(models, mode):
    """Every proposal of a run (batched catch-up, absorbed MLA over the latent caches, module 1
    fed by module 0, the last module recurring) is the dense computation's argmax at each depth."""
    d, made, _ = models
    ckpt, k = MODES[mode]
    engine = LLMEngine.from_checkpoint(
        d / ckpt, EngineConfig(num_kv_blocks=96, speculative=SpeculativeConfig("mtp", k))
    )
    proposer, seen = engine.speculative.proposer, []
    propose = proposer.propose

    def recording(seqs, ks):
        propose(seqs, ks)
        seen.extend((list(s.token_ids), len(s.prompt_token_ids), s.spec_token_ids) for s in seqs if s.spec_token_ids)

    proposer.propose = recording
    run_staggered(engine, _prompts()[:4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), every=2)
    assert len(seen) > 20 and max(len(s[2]) for s in seen) == k
    for tokens, prompt_len, drafts in seen:
        ref = dense_drafts(made[ckpt], tokens, prompt_len - 1, len(drafts))
        for depth, (tok, logits) in enumerate(zip(drafts, ref)):
            assert logits[tok] >= logits.max() - 1e-4, (len(tokens), depth, drafts)


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_model(tmp_path):
    """Temperature 1, a seed per request, tiny vocabulary: the empirical distribution of the 2nd and
    3rd generated tokens matches the target's exact marginals (enumerated), within a TV bound."""
    model = target(1, seed=11, vocab_size=6)
    save_model(tmp_path / "t", model)
    prompt = [1, 2, 1, 2, 1]
    engine = LLMEngine.from_checkpoint(
        tmp_path / "t",
        EngineConfig(
            num_kv_blocks=2048,
            block_size=4,
            speculative=SpeculativeConfig("mtp", 3),
            scheduler=SchedulerConfig(max_num_seqs=256),
        ),
    )
    n = 2000
    for i in range(n):
        engine.add_request(str(i), prompt, SamplingParams(temperature=1.0, max_tokens=3, seed=i, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    assert engine.speculative.stats.accepted > 0
    with torch.no_grad():

        def probs(ctx):
            return torch.softmax(model(torch.tensor([ctx]))[0, -1].double(), -1)

        p1 = probs(prompt)
        p2 = sum(p1[a] * probs(prompt + [a]) for a in range(6))
        p3 = sum(p1[a] * probs(prompt + [a])[b] * probs(prompt + [a, b]) for a in range(6) for b in range(6))
    for pos, exact in ((1, p2), (2, p3)):
        emp = torch.bincount(torch.tensor([o[pos] for o in outs]), minlength=6).double() / n
        tv = 0.5 * (emp - exact).abs().sum()
        assert tv < 0.05, f"token {pos + 1} total variation {tv:.3f}"


def test_a_checkpoint_without_mtp_weights_is_refused(models, tmp_path, capsys):
    d, _, _ = models
    want = "--speculative mtp needs MTP weights: this checkpoint has num_nextn_predict_layers=0"
    with pytest.raises(ValueError, match=want):
        LLMEngine.from_checkpoint(d / "none", EngineConfig(num_kv_blocks=8, speculative=SpeculativeConfig("mtp")))
    from baton.common.cli import main

    # `baton serve` refuses it before it binds a port
    flags = ["--port", "0", "--metrics-port", "-1", "--speculative", "mtp"]
    assert main(["serve", "--model", str(d / "none"), *flags]) == 2
    err = capsys.readouterr().err
    assert want in err and "listening" not in err
    # config.json promises a module (as DeepSeek-V3's do) but the weights lack it: refused, saying so
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    n = CFG["num_hidden_layers"]
    state = {k: v for k, v in load_state_dict(d / "one").items() if not k.startswith(f"model.layers.{n}.")}
    save_file(state, stripped / "model.safetensors")
    (stripped / "config.json").write_text((d / "one" / "config.json").read_text())
    assert json.loads((stripped / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with pytest.raises(ConfigError, match=f"{want} \\(config.json says 1, but no weight file"):
        check_checkpoint(SpeculativeConfig("mtp"), stripped)
    check_checkpoint(SpeculativeConfig("mtp"), d / "one")  # (one that has them passes)
    with pytest.raises(ValueError, match="token trees .* not 'mtp'"):
        SpeculativeConfig("mtp", tree_width=2).validate()


def test_mtp_with_a_sharded_model_is_refused_before_any_worker_starts():
    """The proposer runs beside the engine's own model: rules.py refuses tp/pp before the spawn."""
    from baton.serve.engine.rules import check

    cfg = ModelConfig(**{**CFG, "num_nextn_predict_layers": 1})
    config = EngineConfig(num_kv_blocks=8, speculative=SpeculativeConfig("mtp", 2))
    check(config, cfg, sharded=False)  # (alone it is fine)
    with pytest.raises(ValueError, match="--speculative mtp .* not with tensor/pipeline parallel"):
        check(config, cfg, sharded=True)
