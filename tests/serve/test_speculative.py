"""Speculative decoding is exact: greedy output identical to plain decoding in every mode, sampled
output distributed as the target's, tree verification equal to running each path plainly."""

from __future__ import annotations

import pytest
import torch
from baton.common.checkpoint import load_checkpoint, save_model
from baton.common.config import ModelConfig
from baton.common.eagle import EagleConfig, EagleHead, save_eagle
from baton.common.medusa import MedusaConfig, MedusaHeads, save_medusa
from baton.common.model import build_model, greedy_generate
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig
from baton.serve.speculative import SpecStats, SpeculativeConfig
from baton.serve.speculative.decoder import choose

from .conftest import run_staggered

CFG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    target = build_model(ModelConfig(**CFG), seed=0)
    save_model(d / "target", target)
    heads = MedusaHeads(MedusaConfig(CFG["hidden_size"], CFG["vocab_size"], num_heads=3))
    heads.init_from_lm_head(target.lm_head)
    save_medusa(heads, d / "target")
    save_model(d / "draft", build_model(ModelConfig(**{**CFG, "num_hidden_layers": 1}), seed=5))
    # A draft that often agrees with the target: the target's first layer only.
    sd = {k: v for k, v in target.state_dict().items() if ".layers.1." not in k}
    agreeing = build_model(ModelConfig(**{**CFG, "num_hidden_layers": 1}), seed=0)
    agreeing.load_state_dict(sd)
    save_model(d / "agreeing", agreeing)
    save_eagle(agreeing_eagle(target), d / "target")
    return d, target


def agreeing_eagle(target, steps: int = 120) -> EagleHead:
    """An EAGLE head briefly trained on the target's own greedy continuations: it agrees often
    enough that accepted paths longer than one token occur (their hidden states go to the head)."""
    from baton.train.eagle import eagle_loss, prompt_starts, target_outputs

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, target.config.vocab_size, (16, 8), generator=g)
    data = torch.cat([prompts, greedy_generate(target, prompts, 40)], 1)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig(target.config.to_dict()))
    head.attach(target.model.embed_tokens, target.model.final_norm, target.lm_head)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        batch = data[torch.randint(0, len(data), (8,), generator=g)]
        feats, probs = target_outputs(target, batch)
        loss, _ = eagle_loss(head, feats, probs, batch, starts=prompt_starts(batch, g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def spec_modes(d):
    return {
        "ngram": SpeculativeConfig("ngram", 4),
        "ngram-adaptive": SpeculativeConfig("ngram", 5, adaptive=True),
        "draft": SpeculativeConfig("draft", 4, draft_model=str(d / "draft")),
        "draft-agreeing": SpeculativeConfig("draft", 4, draft_model=str(d / "agreeing")),
        "draft-tree": SpeculativeConfig("draft", 3, draft_model=str(d / "agreeing"), tree_width=3),
        "medusa-chain": SpeculativeConfig("medusa", 3),
        "medusa-tree": SpeculativeConfig("medusa", 3, tree_width=2),
        "medusa-choices": SpeculativeConfig("medusa", 3, tree_choices=MEDUSA_CHOICES),
        "lookahead": SpeculativeConfig("lookahead", lookahead_window=3, lookahead_ngram=3, lookahead_guesses=3),
        "layerskip": SpeculativeConfig("layerskip", 4, exit_layer=1),  # the target's first layer drafts
        "eagle-chain": SpeculativeConfig("eagle", 4),
        "eagle-tree": SpeculativeConfig("eagle", 3, tree_width=2, tree_nodes=5),
    }


MEDUSA_CHOICES = "[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"  # a fixed topology, as Medusa's medusa_choices
MODES = [
    "ngram",
    "ngram-adaptive",
    "draft",
    "draft-agreeing",
    "draft-tree",
    "medusa-chain",
    "medusa-tree",
    "medusa-choices",
    "lookahead",
    "layerskip",
    "eagle-chain",
    "eagle-tree",
]


PROMPT_LENGTHS = (4, 37, 11, 60, 18)


def _prompts():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    return prompts + [[7, 8, 9, 10, 11] * 8]  # repetitive: n-gram lookup has something to find


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pressure", ["roomy", "preempting"])
def test_greedy_identical_to_plain_decoding(models, mode, pressure):
    d, target = models
    prompts = _prompts()
    expected = [greedy_generate(target, torch.tensor([p]), 28)[0].tolist() for p in prompts]
    cfg = EngineConfig(num_kv_blocks=96, block_size=8, speculative=spec_modes(d)[mode])
    if pressure == "preempting":
        cfg = EngineConfig(
            num_kv_blocks=22,
            block_size=8,
            speculative=spec_modes(d)[mode],
            scheduler=SchedulerConfig(max_num_batched_tokens=24, preemption_mode="swap"),
        )
    engine = LLMEngine.from_checkpoint(d / "target", cfg)
    got = run_staggered(engine, prompts, SamplingParams(temperature=0, max_tokens=28, ignore_eos=True), every=2)
    assert got == expected
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.host_free) == bm.num_host_blocks
    assert engine.speculative.stats.proposed > 0
    if mode in ("draft-agreeing", "ngram", "draft-tree", "lookahead", "layerskip", "eagle-chain", "eagle-tree"):
        assert engine.speculative.stats.accepted > 0
    if mode in (
        "draft-tree",
        "lookahead",
        "eagle-chain",
        "eagle-tree",
    ):  # the agreeing draft / the loop prompt: deeper than one token too
        assert all(a > 0 for a in engine.speculative.stats.accepted_by_depth[:2]), engine.speculative.stats
    if pressure == "preempting":
        assert engine.scheduler.num_preemptions > 0
    if mode.startswith("draft") or mode == "layerskip":
        assert engine.speculative.proposer.bm.num_free_blocks == engine.speculative.proposer.bm.num_blocks, (
            "draft KV leaked"
        )


@pytest.mark.parametrize("mode", ["draft-agreeing", "draft-tree", "lookahead", "layerskip", "eagle-tree"])
def test_prefix_caching_with_speculation(models, mode):
    d, target = models
    shared = list(range(1, 41))
    prompts = [shared + [50 + i, 60 + i] for i in range(4)]
    expected = [greedy_generate(target, torch.tensor([p]), 20)[0].tolist() for p in prompts]
    engine = LLMEngine.from_checkpoint(
        d / "target", EngineConfig(num_kv_blocks=64, block_size=8, speculative=spec_modes(d)[mode])
    )
    assert (
        run_staggered(engine, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), every=3)
        == expected
    )
    assert engine.block_manager.prefix_hits > 0


def test_choose_preserves_the_target_distribution():
    """Recursive rejection sampling over random p, q and candidate sets: exact in distribution."""
    g = torch.Generator().manual_seed(0)
    for trial in range(3):
        p = torch.softmax(torch.randn(6, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(6, generator=g) * 2, -1)
        counts = torch.zeros(6)
        n = 20000
        for _ in range(n):
            if trial == 0:  # one draft-sampled candidate with its distribution q
                c = int(torch.multinomial(q, 1, generator=g))
                tok, _ = choose(p, [c], q.unsqueeze(0), g, greedy=False)
            else:  # deterministic candidates (n-gram / Medusa / tree siblings)
                tok, _ = choose(p, [2, 4, 0][: trial + 1], None, g, greedy=False)
            counts[tok] += 1
        tv = 0.5 * (counts / n - p).abs().sum()
        assert tv < 0.02, f"trial {trial}: total variation {tv:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", ["draft", "ngram", "medusa-tree", "draft-tree", "medusa-choices", "lookahead", "layerskip", "eagle"]
)
def test_sampled_tokens_follow_the_target_model(models, tmp_path, mode):
    """Engine level, tiny vocabulary: the empirical distribution of the 2nd and 3rd generated
    tokens matches the target model's exact marginals (enumerated), within a TV bound."""
    d, _ = models
    cfg = dict(CFG, vocab_size=6)
    target = build_model(ModelConfig(**cfg), seed=11)
    save_model(tmp_path / "t", target)
    save_model(tmp_path / "dr", build_model(ModelConfig(**{**cfg, "num_hidden_layers": 1}), seed=3))
    heads = MedusaHeads(MedusaConfig(cfg["hidden_size"], 6, num_heads=2))
    heads.init_from_lm_head(target.lm_head)
    save_medusa(heads, tmp_path / "t")
    torch.manual_seed(2)
    save_eagle(EagleHead(EagleConfig(target.config.to_dict())), tmp_path / "t")  # random: drafts sampled from q
    spec = {
        "draft": SpeculativeConfig("draft", 3, draft_model=str(tmp_path / "dr")),
        "ngram": SpeculativeConfig("ngram", 3, ngram_min=1),
        "medusa-tree": SpeculativeConfig("medusa", 2, tree_width=2),
        "draft-tree": SpeculativeConfig("draft", 2, draft_model=str(tmp_path / "dr"), tree_width=2, tree_nodes=4),
        "medusa-choices": SpeculativeConfig("medusa", 2, tree_choices="[[0], [1], [2], [0, 0], [1, 0]]"),
        "lookahead": SpeculativeConfig("lookahead", lookahead_window=2, lookahead_ngram=3, lookahead_guesses=2),
        "layerskip": SpeculativeConfig("layerskip", 3, exit_layer=1),
        "eagle": SpeculativeConfig("eagle", 3),
    }[mode]
    prompt = [1, 2, 1, 2, 1]
    engine = LLMEngine.from_checkpoint(
        tmp_path / "t",
        EngineConfig(num_kv_blocks=2048, block_size=4, speculative=spec, scheduler=SchedulerConfig(max_num_seqs=256)),
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
            return torch.softmax(target(torch.tensor([ctx]))[0, -1].double(), -1)

        p1 = probs(prompt)
        p2 = sum(p1[a] * probs(prompt + [a]) for a in range(6))
        p3 = sum(p1[a] * probs(prompt + [a])[b] * probs(prompt + [a, b]) for a in range(6) for b in range(6))
    for pos, exact in ((1, p2), (2, p3)):
        emp = torch.bincount(torch.tensor([o[pos] for o in outs]), minlength=6).double() / n
        tv = 0.5 * (emp - exact).abs().sum()
        assert tv < 0.05, f"{mode}: token {pos + 1} total variation {tv:.3f}"


def test_tree_forward_matches_each_path_run_plainly(models):
    d, target = models
    engine = LLMEngine.from_checkpoint(d / "target", EngineConfig(num_kv_blocks=32, block_size=4))
    prompt = list(range(3, 22))
    seq = Sequence(0, "t", 0, prompt, SamplingParams(temperature=0))
    engine.block_manager.allocate_slots(seq, len(prompt) - 1)
    engine.runner.execute([(seq, len(prompt) - 1)])
    seq.num_computed_tokens = len(prompt) - 1
    tokens = [5, 9, 11, 40, 41, 7]
    parents = [-1, -1, 0, 0, 2, 1]  # two branches from the root, a depth-3 path through 0 -> 2 -> 4
    seq.spec_token_ids, seq.spec_parents = tokens, parents
    engine.block_manager.allocate_slots(seq, 1 + len(tokens))
    result = engine.runner.execute([(seq, 1 + len(tokens))])
    logits = result.logits
    assert result.groups == [(seq, 7)]

    def path(i):
        out = []
        while i >= 0:
            out.append(tokens[i])
            i = parents[i]
        return out[::-1]

    with torch.no_grad():
        root = target(torch.tensor([prompt]))[0, -1]
        assert torch.allclose(logits[0], root, atol=1e-4)
        for i in range(len(tokens)):
            plain = target(torch.tensor([prompt + path(i)]))[0, -1]
            assert torch.allclose(logits[i + 1], plain, atol=1e-4), f"node {i} (path {path(i)})"


def test_bad_speculative_configs(models, capsys):
    d, _ = models
    with pytest.raises(ValueError, match="speculative method must be one of"):
        LLMEngine.from_checkpoint(
            d / "target", EngineConfig(num_kv_blocks=8, speculative=SpeculativeConfig("nonesuch"))
        )
    with pytest.raises(FileNotFoundError, match="no EAGLE head .* an `eagle:` recipe"):
        LLMEngine.from_checkpoint(d / "agreeing", EngineConfig(num_kv_blocks=8, speculative=SpeculativeConfig("eagle")))
    from baton.common.cli import main

    # `baton serve` refuses a checkpoint without an EAGLE head before it binds a port
    flags = ["--port", "0", "--metrics-port", "-1", "--speculative", "eagle"]
    assert main(["serve", "--model", str(d / "agreeing"), *flags]) == 2
    err = capsys.readouterr().err
    assert "no EAGLE head" in err and "eagle:" in err and "listening" not in err
    with pytest.raises(ValueError, match="needs draft_model"):
        LLMEngine.from_checkpoint(d / "target", EngineConfig(num_kv_blocks=8, speculative=SpeculativeConfig("draft")))
    with pytest.raises(ValueError, match="disable_above_batch must be >= 1"):
        LLMEngine.from_checkpoint(
            d / "target", EngineConfig(num_kv_blocks=8, speculative=SpeculativeConfig("ngram", disable_above_batch=0))
        )
    other_vocab = build_model(ModelConfig(**{**CFG, "vocab_size": 50}), seed=0)
    save_model(d / "bad-draft", other_vocab)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLMEngine.from_checkpoint(
            d / "target",
            EngineConfig(num_kv_blocks=8, speculative=SpeculativeConfig("draft", draft_model=str(d / "bad-draft"))),
        )
    assert load_checkpoint(d / "target").model is not None


def test_speculation_switches_off_above_the_batch_limit(models):
    """disable_above_batch=2: while 3 sequences decode nothing is proposed; once only 2 are left,
    speculation resumes - and the outputs are plain decoding's either way."""
    d, target = models
    loop = [7, 8, 9, 10, 11] * 8  # n-gram lookup always finds a proposal here
    engine = LLMEngine.from_checkpoint(
        d / "target", EngineConfig(num_kv_blocks=256, speculative=SpeculativeConfig("ngram", 4, disable_above_batch=2))
    )
    lengths = (24, 6, 6)  # the two short requests finish first, then one sequence is left
    for i, n in enumerate(lengths):
        engine.add_request(str(i), loop, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    outputs, proposed_while_full = {}, []
    while engine.has_unfinished_requests():
        full = len(engine.scheduler.running) > 2
        before = engine.speculative.stats.proposed
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if full:
            proposed_while_full.append(engine.speculative.stats.proposed - before)
    assert proposed_while_full and not any(proposed_while_full)
    assert engine.speculative.stats.proposed > 0  # the long request speculated once it ran with fewer
    want = greedy_generate(target, torch.tensor([loop]), max(lengths))[0].tolist()
    for i, n in enumerate(lengths):
        assert outputs[str(i)] == want[:n]


def test_speedup_compares_steps_of_equal_batch_size():
    """By hand: at batch 1 plain steps ran 10 tokens/s, so the 60 speculative tokens would have taken
    6 s plain against the 2 s they took (3x); batch 8 has no plain baseline and is left out."""
    stats = SpecStats()
    assert stats.speedup == 0.0
    stats.time_step(1, True, 1.5, 40)
    stats.time_step(1, True, 0.5, 20)
    stats.time_step(8, True, 1.0, 90)
    assert stats.speedup == 0.0  # no plain step yet
    stats.time_step(1, False, 0.4, 4)
    stats.time_step(1, False, 0.6, 6)
    assert stats.speedup == pytest.approx(3.0)
    stats.time_step(8, False, 0.5, 8)  # batch 8: 16 tokens/s plain, 90 tokens in 1 s speculative
    assert stats.speedup == pytest.approx((6.0 + 90 / 16) / 3.0)


def test_speedup_probe_steps_run_plain_and_keep_the_output(models):
    """Every 3rd decode step runs plain (Medusa proposes at every other one): a batch-1 baseline, so
    the speed-up is measured; greedy output stays plain decoding's."""
    d, target = models
    prompt = _prompts()[1]
    expected = greedy_generate(target, torch.tensor([prompt]), 20)[0].tolist()
    spec = SpeculativeConfig("medusa", 3, speedup_probe_every=3)
    engine = LLMEngine.from_checkpoint(d / "target", EngineConfig(num_kv_blocks=64, block_size=8, speculative=spec))
    assert run_staggered(engine, [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) == [expected]
    stats, steps = engine.speculative.stats, engine.speculative.decode_steps
    assert stats.plain_steps[1][1] >= steps // 3 > 0 and stats.spec_steps[1][1] > 0  # batch 1: a token a plain step
    assert stats.speedup > 0 and engine.stats().spec_speedup == stats.speedup
    with pytest.raises(ValueError, match="speedup_probe_every must be >= 2"):
        SpeculativeConfig("medusa", speedup_probe_every=1).validate()
