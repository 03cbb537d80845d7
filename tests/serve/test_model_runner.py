"""The model runner's packing: single tokens and short chunks become decode rows, longer chunks
the prefill path; either way a step's logits equal a plain forward over the whole sequence."""

import torch

from baton.common.config import ModelConfig
from baton.common.model import DecoderLayer, build_model
from baton.serve.model_runner import DECODE_ROWS, ModelRunner
from baton.serve.sampling_params import SamplingParams
from baton.serve.sequence import Sequence

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def test_short_chunks_run_as_decode_rows_and_match_a_dense_forward():
    model = build_model(CFG, seed=0)
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    g = torch.Generator().manual_seed(0)
    lens = {"a": 10, "b": 13, "c": 20}
    seqs = {}
    for i, (name, n) in enumerate(lens.items()):
        seqs[name] = Sequence(
            i, name, 0, torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist(), SamplingParams()
        )
    seqs["a"].block_table, seqs["b"].block_table, seqs["c"].block_table = [0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11]

    def step(plan):
        step_plan, _ = runner.plan([(seqs[k], n) for k, n in plan])
        md = step_plan.tensors(runner.device)[2]
        result = runner.execute([(seqs[k], n) for k, n in plan])
        logits, groups = result.logits, result.groups
        for k, n in plan:
            seqs[k].num_computed_tokens += n
        return md, logits, groups

    md, _, groups = step([("a", 9), ("b", 7)])  # a: a 9-token chunk (prefill path), b: 7 decode rows
    assert 7 <= DECODE_ROWS < 9
    assert md.num_decodes == 7 and md.decode_context_lens.tolist() == list(range(1, 8))
    assert md.prefill_prefix_lens.tolist() == [0] and groups == []  # neither sequence is complete yet

    md, logits, groups = step([("c", 20), ("b", 6), ("a", 1)])  # c: prefill; b: 6 rows over a cached prefix
    assert md.num_decodes == 6 + 1 and md.decode_context_lens.tolist() == [8, 9, 10, 11, 12, 13, 10]
    assert [s.request_id for s, _ in groups] == ["b", "a", "c"]  # decode rows first, then chunks
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([s.token_ids]))[0, -1] for s, _ in groups])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_the_model_runner_fuses_residual_norms():
    model = build_model(
        ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
        seed=0,
    )
    ModelRunner(model, num_blocks=8, block_size=8)
    assert all(m.fuse_residual_norm for m in model.modules() if isinstance(m, DecoderLayer))
