"""Ring attention over 2 and 4 ranks (causal, zigzag-split, GQA) equals SDPA over the whole
sequence, forward and backward, in float64: only rounding may differ."""

from __future__ import annotations

import pytest
import torch

from baton.train.parallel.context_parallel import _blocks, zigzag_indices


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_full_attention(harness, world):
    errors = harness.ring(world)
    assert len(errors) == world
    for rank, errs in enumerate(errors):
        for name, err in errs.items():
            assert err < 1e-12, f"rank {rank}: {name} differs by {err:.2e} (relative)"


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_covers_the_sequence_and_balances_causal_work(cp):
    seq = 8 * cp
    held = [zigzag_indices(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq))
    # Causal (query, key) pairs each rank computes over the whole ring: equal for every rank,
    # and exactly the pairs with key position <= query position.
    n = seq // cp
    work = []
    for r in range(cp):
        pairs = 0
        for step in range(cp):
            rows, cols, causal = _blocks(step, r, cp, n)
            src = (r - step) % cp
            q, k = held[r][rows], held[src][cols]
            allowed = k[None, :] <= q[:, None]
            assert causal or bool(allowed.all()), "a non-causal block must not contain masked pairs"
            pairs += int(allowed.sum()) if causal else allowed.numel()
        exact = int((held[r][:, None] >= torch.arange(seq)[None, :]).sum())
        assert pairs == exact, f"rank {r} computes {pairs} pairs, causal attention needs {exact}"
        work.append(pairs)
    assert len(set(work)) == 1, f"zigzag should balance causal work, got {work}"
