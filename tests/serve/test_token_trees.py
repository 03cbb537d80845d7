"""Token trees: the builders (EAGLE-2's dynamic rule, fixed Medusa topologies, n-gram tries) by
hand, the tree mask through both attention paths (C++ kernel, torch SDPA) against each path run
plainly, and checks that must fail: a corrupted ancestor mask changes the greedy output, and a
verifier that accepts nothing fails the per-depth acceptance check."""

from __future__ import annotations

import math

import baton.serve.runner.attention as attention
import baton.serve.runner.step_plan as step_plan
import baton.serve.speculative.decoder as decoder
import pytest
import torch
from baton.common.model import greedy_generate
from baton.serve.core.sequence import Sequence
from baton.serve.core.token_tree import ancestor_mask
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.speculative import SpeculativeConfig
from baton.serve.speculative.tree import ScoredTree, choice_tree, parse_choices, trie

from .conftest import run_staggered
from .test_speculative import models  # noqa: F401 (the module's checkpoints: target, agreeing draft, Medusa heads)


def test_dynamic_tree_expands_and_keeps_the_most_likely_paths():
    t = ScoredTree(width=2)
    p1 = torch.tensor([0.1, 0.6, 0.3])
    assert t.expand(-1, p1) == [0, 1]  # tokens 1 (0.6) and 2 (0.3)
    assert t.tokens == [1, 2]
    kids = [c for i in t.frontier([0, 1]) for c in t.expand(i, torch.tensor([0.5, 0.1, 0.4]))]
    assert kids == [2, 3, 4, 5]
    # cumulative: 0.6, 0.3, 0.6*0.5=0.3, 0.6*0.4=0.24, 0.3*0.5=0.15, 0.3*0.4=0.12
    assert t.scores == pytest.approx([math.log(x) for x in (0.6, 0.3, 0.3, 0.24, 0.15, 0.12)])
    assert t.frontier(kids) == [2, 3]
    tokens, parents = t.select(4)  # 0.6, 0.3 (depth 1 wins the tie), 0.3, 0.24
    assert (tokens, parents) == ([1, 2, 0, 2], [-1, -1, 0, 0])


def test_fixed_topology_and_trie():
    paths = parse_choices("[[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]]")
    assert paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    top = [[10, 11], [20, 21], [30, 31]]  # each head's ranked candidates
    assert choice_tree(paths, top) == ([10, 11, 20, 21, 20, 30], [-1, -1, 0, 0, 1, 2])
    assert choice_tree(paths, top[:2]) == ([10, 11, 20, 21, 20], [-1, -1, 0, 0, 1])  # k = 2: depth 3 dropped
    assert trie([[5, 6, 7], [5, 6, 8], [9]]) == ([5, 6, 7, 8, 9], [-1, 0, 1, 1, -1])
    for bad in ("[[0, 0]]", "[[]]", "0", "[[0], [0]]", "[[-1]]"):
        with pytest.raises(ValueError, match="tree_choices"):
            parse_choices(bad)


# A tree with a sibling fan-out and a lookahead window's shape: a chain with diagonals under it.
TREES = {
    "fan": ([5, 9, 11, 40, 41, 7], [-1, -1, 0, 0, 2, 1]),
    "window": ([3, 4, 5, 6, 7, 8], [-1, 0, 1, 0, 1, 2]),  # level 0: 3 4 5, level 1 under each
}


def _tree_logits(engine, prompt, tokens, parents):
    seq = Sequence(0, "t", 0, prompt, SamplingParams(temperature=0))
    engine.block_manager.allocate_slots(seq, len(prompt) - 1)
    engine.runner.execute([(seq, len(prompt) - 1)])
    seq.num_computed_tokens = len(prompt) - 1
    seq.spec_token_ids, seq.spec_parents = list(tokens), list(parents)
    engine.block_manager.allocate_slots(seq, 1 + len(tokens))
    return engine.runner.execute([(seq, 1 + len(tokens))]).logits


@pytest.mark.parametrize("path", ["cpp", "torch"])
@pytest.mark.parametrize("shape", list(TREES))
def test_tree_mask_on_both_attention_paths(models, monkeypatch, path, shape):  # noqa: F811
    """Every node's logits equal its root-to-node path run plainly; with one ancestor link
    dropped from the mask, the node below it no longer does."""
    d, target = models
    calls = []
    if path == "torch":
        monkeypatch.setattr(attention, "cpu_kernel_fits", lambda *a: False)
    else:
        real = attention.paged_attention_decode_cpu
        monkeypatch.setattr(attention, "paged_attention_decode_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = LLMEngine.from_checkpoint(d / "target", EngineConfig(num_kv_blocks=32, block_size=4))
    prompt = list(range(3, 22))
    tokens, parents = TREES[shape]
    logits = _tree_logits(engine, prompt, tokens, parents)
    assert (len(calls) > 0) == (path == "cpp"), "the attention path under test did not run"

    def path_of(i):
        out = []
        while i >= 0:
            out.append(tokens[i])
            i = parents[i]
        return out[::-1]

    with torch.no_grad():
        plain = [target(torch.tensor([prompt + path_of(i)]))[0, -1] for i in range(len(tokens))]
    for i in range(len(tokens)):
        assert torch.allclose(logits[i + 1], plain[i], atol=1e-4), f"node {i} (path {path_of(i)})"

    deep = max(range(len(tokens)), key=lambda i: len(path_of(i)))

    def corrupted(ps):  # the deepest node forgets its grandparent
        mask = ancestor_mask(ps)
        mask[deep + 1, ps[ps[deep]] + 1] = False
        return mask

    monkeypatch.setattr(step_plan, "ancestor_mask", corrupted)
    engine = LLMEngine.from_checkpoint(d / "target", EngineConfig(num_kv_blocks=32, block_size=4))
    bad = _tree_logits(engine, prompt, tokens, parents)
    assert not torch.allclose(bad[deep + 1], plain[deep], atol=1e-4), "a wrong ancestor mask went unnoticed"


def _agreeing_tree(d) -> SpeculativeConfig:
    return SpeculativeConfig("draft", 3, draft_model=str(d / "agreeing"), tree_width=2, tree_nodes=6)


def _run(d, target, spec):
    prompts = [list(range(5, 5 + n)) for n in (9, 30, 4)]
    expected = [greedy_generate(target, torch.tensor([p]), 16)[0].tolist() for p in prompts]
    engine = LLMEngine.from_checkpoint(d / "target", EngineConfig(num_kv_blocks=64, block_size=8, speculative=spec))
    got = run_staggered(engine, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), every=2)
    return got, expected, engine.speculative.stats


def check_accepts_at_every_depth(stats, depths: int) -> None:
    """The per-depth acceptance a proposer known to agree must show."""
    assert len(stats.accepted_by_depth) >= depths, stats
    assert all(a > 0 for a in stats.accepted_by_depth[:depths]), stats
    assert all(0 < r <= 1 for r in stats.acceptance_by_depth[:depths]), stats


def test_dynamic_draft_tree_accepts_at_every_depth(models):  # noqa: F811
    d, target = models
    got, expected, stats = _run(d, target, _agreeing_tree(d))
    assert got == expected
    check_accepts_at_every_depth(stats, 2)
    assert stats.accepted == sum(stats.accepted_by_depth) and stats.steps == stats.proposed_by_depth[0]


def test_a_verifier_that_accepts_nothing_fails_the_check(models, monkeypatch):  # noqa: F811
    d, target = models
    real = decoder.choose

    def reject(p, candidates, q, generator, greedy):
        token, _ = real(p, [], None, generator, greedy)
        return token, -1

    monkeypatch.setattr(decoder, "choose", reject)
    got, expected, stats = _run(d, target, _agreeing_tree(d))
    assert got == expected  # (still exact: every token is the target's own)
    with pytest.raises(AssertionError):
        check_accepts_at_every_depth(stats, 2)


def test_a_wrong_ancestor_mask_changes_the_output(models, monkeypatch):  # noqa: F811
    """Every node sees every earlier node (a causal mask over the packed tree): siblings leak
    into each other's context and greedy decoding no longer matches plain decoding."""
    d, target = models
    monkeypatch.setattr(step_plan, "ancestor_mask", lambda ps: torch.ones(len(ps) + 1, len(ps) + 1).tril().bool())
    got, expected, _ = _run(d, target, _agreeing_tree(d))
    assert got != expected


@pytest.mark.parametrize(
    "spec, words",
    [
        (SpeculativeConfig("ngram", tree_width=2), "token trees"),
        (SpeculativeConfig("lookahead", tree_nodes=4), "token trees"),
        (SpeculativeConfig("medusa", tree_choices="[[0, 1]]"), "parent of path"),
        (SpeculativeConfig("medusa", tree_choices="[[0]]", tree_width=2), "fixed Medusa topology"),
        (SpeculativeConfig("draft", draft_model="x", tree_width=2, tree_nodes=0), "tree_nodes must be >= 1"),
        (SpeculativeConfig("ngram", draft_model="x"), "draft_model is for"),
    ],
)
def test_bad_tree_configs_are_refused(spec, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(speculative=spec).validate()


def test_a_bad_combination_is_refused_before_serving(monkeypatch, tmp_path, capsys):
    import baton.serve.server as server_module
    from baton.common.cli import main

    seen = []
    monkeypatch.setattr(server_module, "run", lambda config: seen.append(config) or 0)
    argv = ["serve", "--model", str(tmp_path), "--speculative", "lookahead", "--speculative-tree-width", "2"]
    assert main(argv) == 2
    assert "token trees" in capsys.readouterr().err and not seen


def test_topology_deeper_than_the_heads_is_refused(models):  # noqa: F811
    d, _ = models
    spec = SpeculativeConfig("medusa", 4, tree_choices="[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]")
    with pytest.raises(ValueError, match="deeper than the checkpoint's 3 Medusa heads"):
        LLMEngine.from_checkpoint(d / "target", EngineConfig(num_kv_blocks=8, speculative=spec))
