"""Impossible layouts are rejected by arithmetic alone, with a message naming the problem, before
any process group exists; and pipeline stages are balanced."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from baton.common.config import ConfigError, ModelConfig, preset
from baton.train.parallel.layout import ParallelConfig, check_layout, data_parallel_rank, data_parallel_size
from baton.train.parallel.pipeline import split_layers, stage_costs

MODEL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)

BAD = [
    # (parallel config, world size, micro-batches, seq_len, model overrides, expected message)
    (dict(tp=3), 4, 4, 16, {}, "world size 4 is not divisible by tp x pp x cp = 3 x 1 x 1 = 3"),
    (dict(dp=3, tp=2), 4, 4, 16, {}, "dp x tp x pp x cp = 3 x 2 x 1 x 1 = 6 != world size 4"),
    (dict(tp=8), 8, 4, 16, {}, "num_attention_heads 4 is not divisible by tp=8"),
    (dict(tp=2), 2, 4, 16, dict(num_key_value_heads=1), "num_key_value_heads 1 is not divisible by tp=2"),
    (dict(tp=2), 2, 4, 16, dict(intermediate_size=63), "intermediate_size 63 is not divisible by tp=2"),
    (dict(tp=2), 2, 4, 16, dict(num_local_experts=4), "tensor parallelism of MoE experts is not supported"),
    (dict(tp=2), 2, 4, 17, {}, "sequence parallelism needs seq_len 17 divisible by tp x cp = 2"),
    (dict(tp=2, dp_mode="ddp"), 4, 4, 16, {}, "dp_mode ddp cannot wrap tensor-parallel (DTensor) parameters"),
    (dict(pp=8), 8, 8, 16, {}, "8 pipeline stages (pp=8 x pp_stages_per_rank=1) but only 4 layers"),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=3), 2, 4, 16, {},
     "6 pipeline stages (pp=2 x pp_stages_per_rank=3) but only 4 layers"),
    (dict(pp=4), 4, 2, 16, {}, "1f1b needs at least as many micro-batches per step as pipeline ranks: 2 micro-batches < pp=4"),
    (dict(pp=2, pp_schedule="interleaved_1f1b"), 2, 4, 16, {}, "interleaved_1f1b needs pp_stages_per_rank >= 2"),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2), 2, 5, 16, {},
     "interleaved_1f1b needs the micro-batches (5) to be a multiple of 2"),
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


@pytest.mark.parametrize("par, world", [(dict(), 4), (dict(tp=2, pp=2), 4), (dict(cp=2, tp=2), 4), (dict(pp=4), 4),
                                        (dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2), 2)])
def test_good_layouts_resolve_dp(par, world):
    config = ParallelConfig(**par)
    layout = check_layout(config, ModelConfig(**MODEL), world, 4, 16)
    assert layout.world_size == world and layout.dp == world // (layout.tp * layout.pp * layout.cp)
    assert data_parallel_size(config, world) == layout.dp
    # Ranks of one replica (all its tp, cp and pp ranks) train on the same share of the batch.
    ranks = torch.arange(world).view(layout.pp, layout.dp, layout.cp, layout.tp)
    for r in range(world):
        assert data_parallel_rank(config, r, world) == int((ranks == r).nonzero()[0, 1])


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
