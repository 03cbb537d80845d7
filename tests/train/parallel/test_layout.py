"""Impossible layouts are rejected by arithmetic alone, with a message naming the problem, before
any process group exists; possible ones resolve to degrees, data-parallel ranks and (on torch's fake
backend, one process per rank in turn) process groups written out by hand; pipeline stages are balanced."""

from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist

from baton.common.config import ConfigError, ModelConfig, preset
from baton.train.parallel.layout import ParallelConfig, check_layout, data_parallel_rank, data_parallel_size
from baton.train.parallel.mesh import build_mesh
from baton.train.parallel.pipeline import split_layers, stage_costs

MODEL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

BAD = [
    # (parallel config, world size, micro-batches, seq_len, model overrides, expected message)
    (dict(tp=3), 4, 4, 16, {}, "world size 4 is not divisible by tp x pp x cp = 3 x 1 x 1 = 3"),
    (dict(dp=3, tp=2), 4, 4, 16, {}, "dp x tp x pp x cp = 3 x 2 x 1 x 1 = 6 != world size 4"),
    (dict(tp=8), 8, 4, 16, {}, "num_attention_heads 4 is not divisible by tp=8"),
    (dict(tp=2), 2, 4, 16, dict(num_key_value_heads=1), "num_key_value_heads 1 is not divisible by tp=2"),
    (dict(tp=2), 2, 4, 16, dict(intermediate_size=63), "intermediate_size 63 is not divisible by tp=2"),
    (dict(tp=2), 2, 4, 17, {}, "sequence parallelism needs seq_len 17 divisible by tp x cp = 2"),
    (dict(tp=2, dp_mode="ddp"), 4, 4, 16, {}, "dp_mode ddp cannot wrap tensor-parallel (DTensor) parameters"),
    (dict(pp=8), 8, 8, 16, {}, "8 pipeline stages (pp=8 x pp_stages_per_rank=1) but only 4 layers"),
    (
        dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=3),
        2,
        4,
        16,
        {},
        "6 pipeline stages (pp=2 x pp_stages_per_rank=3) but only 4 layers",
    ),
    (
        dict(pp=4),
        4,
        2,
        16,
        {},
        "1f1b needs at least as many micro-batches per step as pipeline ranks: 2 micro-batches < pp=4",
    ),
    (dict(pp=2, pp_schedule="interleaved_1f1b"), 2, 4, 16, {}, "interleaved_1f1b needs pp_stages_per_rank >= 2"),
    (
        dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2),
        2,
        5,
        16,
        {},
        "interleaved_1f1b needs the micro-batches (5) to be a multiple of 2",
    ),
    (dict(pp=2, pp_stages_per_rank=2), 2, 4, 16, {}, "pp_schedule 1f1b runs one stage per rank"),
    (dict(pp=2), 2, 4, 16, dict(tie_word_embeddings=True), "tie_word_embeddings with pp > 1"),
    (dict(cp=2), 2, 4, 18, {}, "context parallelism needs seq_len 18 divisible by 2 x cp = 4"),
    (dict(cp=2), 2, 4, 16, dict(sliding_window=8), "context parallelism with sliding-window attention"),
    (dict(pp_schedule="zb"), 1, 4, 16, {}, "pp_schedule must be one of"),
    (dict(dp_mode="zero"), 1, 4, 16, {}, "dp_mode must be one of"),
    (dict(tp=0), 1, 4, 16, {}, "tp must be a positive integer, got 0"),
]


@pytest.mark.parametrize("par, world, micro, seq, model, message", BAD, ids=[b[-1][:40] for b in BAD])
def test_bad_layout_is_rejected_with_its_message(par, world, micro, seq, model, message):
    with pytest.raises(ConfigError, match="invalid parallel layout") as e:
        check_layout(ParallelConfig(**par), ModelConfig(**{**MODEL, **model}), world, micro, seq)
    assert message in str(e.value)
    assert not (dist.is_available() and dist.is_initialized())  # decided before any process group


# (parallel config, world size, resolved (dp, pp, cp, tp), data-parallel rank of each global rank), by hand:
# the mesh is (pp, dp, cp, tp) row-major, so rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i.
GOOD = [
    (dict(), 4, (4, 1, 1, 1), [0, 1, 2, 3]),
    (dict(tp=2, pp=2), 4, (1, 2, 1, 2), [0, 0, 0, 0]),
    (dict(cp=2, tp=2), 4, (1, 1, 2, 2), [0, 0, 0, 0]),
    (dict(pp=4), 4, (1, 4, 1, 1), [0, 0, 0, 0]),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2), 2, (1, 2, 1, 1), [0, 0]),
    (dict(tp=2, pp=2), 8, (2, 2, 1, 2), [0, 0, 1, 1, 0, 0, 1, 1]),
    (dict(dp=2, tp=2, pp=2), 8, (2, 2, 1, 2), [0, 0, 1, 1, 0, 0, 1, 1]),
    (dict(tp=2, cp=2), 8, (2, 1, 2, 2), [0, 0, 0, 0, 1, 1, 1, 1]),
    (dict(tp=2), 8, (4, 1, 1, 2), [0, 0, 1, 1, 2, 2, 3, 3]),
    (dict(pp=2), 8, (4, 2, 1, 1), [0, 1, 2, 3, 0, 1, 2, 3]),
]


@pytest.mark.parametrize("par, world, degrees, dp_ranks", GOOD, ids=[f"{g[1]}-{g[0]}" for g in GOOD])
def test_good_layouts_resolve_to_hand_computed_degrees(par, world, degrees, dp_ranks):
    config = ParallelConfig(**par)
    layout = check_layout(config, ModelConfig(**MODEL), world, 4, 16)
    assert (layout.dp, layout.pp, layout.cp, layout.tp) == degrees
    assert layout.world_size == world
    assert layout.num_stages == layout.pp * config.pp_stages_per_rank
    assert data_parallel_size(config, world) == degrees[0]
    # Ranks of one replica (all its tp, cp and pp ranks) train on the same share of the batch.
    assert [data_parallel_rank(config, r, world) for r in range(world)] == dp_ranks


# Process groups of world 8, written out by hand (not computed the way the code computes them).
GROUPS_8 = {
    "tp2 x pp2 x dp2": (
        dict(tp=2, pp=2),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "cp": [[r] for r in range(8)],
            "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],  # gradients are averaged over dp x cp
        },
    ),
    "tp2 x cp2 x dp2": (
        dict(tp=2, cp=2),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "pp": [[r] for r in range(8)],
            "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        },
    ),
}


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """One process playing `rank` of `world` (torch's fake backend: groups exist, nothing is sent)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(GROUPS_8))
def test_mesh_groups_match_hand_computed_ranks(name):
    par, groups = GROUPS_8[name]
    for kind, members in groups.items():  # the table itself: each kind partitions the 8 ranks evenly
        assert sorted(r for g in members for r in g) == list(range(8)) and len({len(g) for g in members}) == 1
    config = ParallelConfig(**par)
    layout = check_layout(config, ModelConfig(**MODEL), 8, 4, 16)
    assert {k: len(groups[k][0]) for k in ("dp", "pp", "cp", "tp")} == {
        "dp": layout.dp,
        "pp": layout.pp,
        "cp": layout.cp,
        "tp": layout.tp,
    }
    for rank in range(8):
        with fake_world(rank, 8):
            mesh = build_mesh(layout)
            for kind, members in groups.items():
                want = next(g for g in members if rank in g)
                sub = mesh.data if kind == "dp_cp" else mesh[kind]
                assert sub.mesh.flatten().tolist() == want, (kind, rank)
                if kind != "dp_cp":
                    assert dist.get_process_group_ranks(mesh.group(kind)) == want, (kind, rank)
                    assert mesh.rank(kind) == want.index(rank)
            assert data_parallel_rank(config, rank, 8) == mesh.rank("dp")
            assert mesh.is_last_stage_rank == (rank in [g[-1] for g in groups["pp"]])


def test_mesh_refuses_a_layout_for_another_world_size():
    layout = check_layout(ParallelConfig(tp=2, pp=2), ModelConfig(**MODEL), 8, 4, 16)
    with fake_world(0, 4), pytest.raises(RuntimeError, match="needs 8 processes, the group has 4"):
        build_mesh(layout)


def test_vocabulary_need_not_divide_by_tp():
    """Vocab-parallel embedding and loss handle uneven vocabulary shards (a char tokenizer's)."""
    check_layout(ParallelConfig(tp=2), ModelConfig(**{**MODEL, "vocab_size": 67}), 2, 4, 16)


def test_stages_balance_layers_and_head():
    assert split_layers(4, 2, 0.4) == [range(0, 2), range(2, 4)]
    assert split_layers(4, 4, 0.4) == [range(i, i + 1) for i in range(4)]
    # A head worth two layers: the last stage gets two layers fewer.
    assert split_layers(8, 2, 2.0) == [range(0, 5), range(5, 8)]
    for layers, stages in ((16, 4), (7, 3), (32, 8)):
        ranges = split_layers(layers, stages, 1.5)
        assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]] and ranges[-1].stop == layers
        assert min(len(r) for r in ranges) >= 1
    # Llama-3.2-1B: its 128k-vocabulary head costs as much as four decoder layers.
    layer, head = stage_costs(preset("llama-1b"))
    assert layer == 1.0 and 4 < head < 5
