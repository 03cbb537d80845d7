"""Lookahead decoding: the Jacobi window's tree shape and update by hand, and the window rows'
logits in the engine equal to each window token's diagonal path run plainly (greedy exactness,
preemption, prefix caching and the sampled distribution are in test_speculative.py)."""

from __future__ import annotations

import torch
from baton.serve.core.sequence import Sequence
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampling_params import SamplingParams
from baton.serve.speculative import SpeculativeConfig
from baton.serve.speculative.lookahead import LookaheadProposer

from .test_speculative import models  # noqa: F401 (the module's checkpoints)


def _one_hot(tokens: list[int], vocab: int = 50) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def test_window_shape_jacobi_step_and_pool_by_hand():
    cfg = SpeculativeConfig("lookahead", lookahead_window=2, lookahead_ngram=3, lookahead_guesses=2)
    prop = LookaheadProposer(cfg)
    seq = Sequence(0, "r", 0, [1, 2, 3], SamplingParams(temperature=0))
    st = prop._state(seq)
    st.levels = [[10, 11]]  # level 0 (what the random start would be)
    assert st.pool == {1: [(2, 3)]}  # the sequence's own 3-gram
    prop.propose([seq], {0: 2})
    assert (seq.spec_token_ids, seq.spec_parents) == ([10, 11], [-1, 0]) and prop.window_rows(seq) == 2
    prop.window_logits(seq, _one_hot([20, 21]))  # warm-up: the predictions become level 1
    assert st.levels == [[10, 11], [20, 21]]
    prop.propose([seq], {0: 2})
    # level 0 a chain under the root, level 1 token j under level 0 token j
    assert (seq.spec_token_ids, seq.spec_parents) == ([10, 11, 20, 21], [-1, 0, 0, 1])
    prop.window_logits(seq, _one_hot([0, 0, 30, 31]))  # only the newest level's rows count
    assert st.levels == [[20, 21], [30, 31]]
    assert st.pool[10] == [(20, 30)] and st.pool[11] == [(21, 31)]  # the diagonals
    seq.token_ids.append(10)  # the next root: the pool's guess for it comes first, then the window
    prop.propose([seq], {0: 2})
    assert seq.spec_token_ids == [20, 30, 20, 21, 30, 31]
    assert seq.spec_parents == [-1, 0, -1, 2, 2, 3] and prop.window_rows(seq) == 4


def test_window_rows_see_their_diagonal_path(models, monkeypatch):  # noqa: F811
    """Each window token's logits in the verification pass equal the target run plainly on the
    context, the root, and the tokens before it on its diagonal (level 0 up to its column, then
    the levels above it in that column)."""
    d, target = models
    cfg = SpeculativeConfig("lookahead", lookahead_window=3, lookahead_ngram=3, lookahead_guesses=2)
    engine = LLMEngine.from_checkpoint(d / "target", EngineConfig(num_kv_blocks=64, block_size=8, speculative=cfg))
    prop = engine.speculative.proposer
    seen: list[tuple[list[int], list[list[int]], torch.Tensor]] = []
    propose, window_logits = prop.propose, prop.window_logits

    def spy_propose(seqs, ks):
        propose(seqs, ks)
        for s in seqs:
            s._lookahead_view = (list(s.token_ids), [list(lv) for lv in prop.state[s.seq_id].levels])

    def spy_window(seq, logits):
        seen.append((*seq._lookahead_view, logits.clone()))
        window_logits(seq, logits)

    monkeypatch.setattr(prop, "propose", spy_propose)
    monkeypatch.setattr(prop, "window_logits", spy_window)
    engine.add_request("0", list(range(20, 45)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(seen) >= 3 and any(len(levels) == 2 for _, levels, _ in seen)
    with torch.no_grad():
        for context, levels, logits in seen:
            rows = iter(logits)
            for lvl in range(len(levels)):
                for j in range(3):
                    path = levels[0][: j + 1] + [levels[m][j] for m in range(1, lvl + 1)]
                    want = target(torch.tensor([context + path]))[0, -1]
                    assert torch.allclose(next(rows), want, atol=1e-4), (lvl, j)
    assert engine.speculative.stats.steps > 0
