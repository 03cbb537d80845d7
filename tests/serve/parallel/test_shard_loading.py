"""load_shard in one process, every checkpoint format: each tensor-parallel rank's shard, combined by
hand (column outputs concatenated, row-parallel partial products summed), reproduces the unsharded
model's layers. The expected slices are derived here from the layout (Megatron's split, GQA's head
mapping), not read back from shard.py, so a wrong cut in either place fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.serve.parallel.loader import load_shard
from baton.serve.parallel.shard import Placeholder, Shard
from baton.serve.quantization import QuantConfig, load_model, save_quantized
from baton.serve.quantization.linear import QuantLinear, set_compute_dtype
from baton.serve.quantization.quantize import quantize_model

# hidden 48 = 1.5 int4 groups of 32: q/k/v/gate/up pad their inputs (column splits keep the padding);
# the row-split widths (4 heads x 16 = 64 attention outputs, 128 MLP columns) are whole groups at T=2.
# Vocabulary 101 does not divide 2 or 4: the last rank's embedding rows are padded. Random biases on
# q/k/v/o: a row-parallel bias added on every rank (not once) shows.
DENSE = dict(
    vocab_size=101,
    hidden_size=48,
    head_dim=16,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    max_position_embeddings=256,
    attention_bias=True,
)
MOE = {**DENSE, "attention_bias": False, "num_local_experts": 4, "num_experts_per_tok": 2}
VARIANTS: dict[str, tuple[dict, QuantConfig | None]] = {
    "float": (DENSE, None),
    "float-tied": ({**DENSE, "tie_word_embeddings": True, "attention_bias": False, "qkv_bias": True}, None),
    "gptq-int4": (DENSE, QuantConfig("gptq", 4, 32)),
    "awq-int4": (DENSE, QuantConfig("awq", 4, 32, awq_grid=5)),
    "rtn-int8": (DENSE, QuantConfig("rtn", 8)),
    "fp8": (DENSE, QuantConfig("fp8", 8)),
    "w8a8": (DENSE, QuantConfig("smoothquant", 8)),
    "moe-int4": (MOE, QuantConfig("rtn", 4, 32)),
    # 96 MLP columns split 2 ways are 48: not whole int4 groups of 32, so T=2 must be refused
    "int4-misaligned": ({**DENSE, "intermediate_size": 96}, QuantConfig("rtn", 4, 32)),
}
SPLITTABLE = [v for v in VARIANTS if v != "int4-misaligned"]
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
ROW = ("o_proj", "down_proj", "w2")


def checkpoint(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """VARIANTS[name] as a checkpoint, built once per test session (every parallel test file shares it)."""
    out = tmp_path_factory.getbasetemp() / "parallel-checkpoints" / name
    if out.is_dir():
        return out
    out.parent.mkdir(exist_ok=True)
    cfg, qcfg = VARIANTS[name]
    model = build_model(ModelConfig(**cfg), seed=0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1, generator=g)
    if qcfg is None:
        return save_model(out, model)
    calib = torch.randint(0, cfg["vocab_size"], (16, 32), generator=torch.Generator().manual_seed(1))
    return save_quantized(out, quantize_model(model, qcfg, calib), qcfg)


def _kv_columns(cfg: ModelConfig, tp: int, r: int) -> slice:
    """k/v rows rank r needs: the KV heads its query heads attend with (GQA: query head j uses KV
    head j // (heads / kv_heads))."""
    per_rank = cfg.num_attention_heads // tp
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    first, last = (r * per_rank) // group, ((r + 1) * per_rank - 1) // group
    return slice(first * cfg.head_dim, (last + 1) * cfg.head_dim)


def _fake_w8a8(x: torch.Tensor, mod: QuantLinear, cols: slice) -> torch.Tensor:
    """Per-token int8 activations (scale from this slice's max) times the dequantized weight columns,
    in float64: what a row-parallel rank of a W8A8 layer computes."""
    x = x.double()
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
    return ((torch.round(x / s).clamp(-127, 127) * s) @ mod.dequantize().double()[:, cols].T).float()


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear)) and ".layers." in n}


@pytest.mark.parametrize(
    "name,tp",
    [(v, 2) for v in SPLITTABLE] + [("float", 4), ("rtn-int8", 4), ("fp8", 4)],  # T=4: 2 KV heads replicated
)
def test_shards_combine_to_the_unsharded_layers(tmp_path_factory, name, tp):
    d = checkpoint(tmp_path_factory, name)
    full = load_model(d).model
    shards = [load_shard(d, Shard(r, tp)) for r in range(tp)]
    for m in (full, *shards):
        set_compute_dtype(m, None)  # exact activations (CPU int8 defaults to bf16 ones)
    cfg = full.config
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0))
    checked = set()
    with torch.no_grad():
        for lname, ref in _linears(full).items():
            kind = lname.rsplit(".", 1)[-1]
            xin = x[:, : ref.in_features]
            want = ref(xin)
            parts = [s.get_submodule(lname) for s in shards]
            if kind in ROW:
                k = ref.in_features // tp
                assert all(p.in_features == k for p in parts), lname
                # .forward: the rank's partial product, without the all-reduce hook __call__ runs
                got = sum(p.forward(xin[:, r * k : (r + 1) * k]) for r, p in enumerate(parts))
                if isinstance(ref, QuantLinear) and ref.format == "w8a8":
                    # each rank quantizes its own slice of the activations (per-token scale from that
                    # slice), as vLLM does: exact against that reference, within int8 error of T=1.
                    bias = ref.bias if ref.bias is not None else 0
                    rows = [_fake_w8a8(xin[:, r * k : (r + 1) * k], ref, slice(r * k, (r + 1) * k)) for r in range(tp)]
                    torch.testing.assert_close(got, sum(rows) + bias, rtol=1e-4, atol=1e-5)
                    assert (got - want).abs().max() < 0.03 * want.abs().max(), lname
                else:
                    torch.testing.assert_close(got, want, msg=lname)
            elif kind in COLUMN:
                for r, p in enumerate(parts):
                    n = ref.out_features // tp
                    cols = _kv_columns(cfg, tp, r) if kind in ("k_proj", "v_proj") else slice(r * n, (r + 1) * n)
                    torch.testing.assert_close(p(xin), want[:, cols], msg=lname)
            else:  # the MoE router: replicated, so every rank routes alike
                assert kind == "gate", lname
                for p in parts:
                    assert torch.equal(p(xin), want)
            checked.add(kind)
        assert checked >= (
            {"q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3", "gate"}
            if cfg.num_local_experts
            else {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        )
        # Vocabulary-parallel embedding and LM head: ceil(V / T) rows each, the padding rows zero.
        vp = -(-cfg.vocab_size // tp)
        emb = torch.cat([s.model.embed_tokens.weight for s in shards])
        assert emb.shape == (vp * tp, cfg.hidden_size)
        assert torch.equal(emb[: cfg.vocab_size], full.model.embed_tokens.weight)
        assert not emb[cfg.vocab_size :].any()
        h = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        logits = torch.cat([s.lm_head.forward(h) for s in shards], -1)  # .forward: without the all-gather
        torch.testing.assert_close(logits[:, : cfg.vocab_size], full.lm_head(h))
        for s in shards:  # norms are replicated
            assert torch.equal(s.model.norm.weight, full.model.norm.weight)
            assert torch.equal(s.model.layers[1].input_layernorm.weight, full.model.layers[1].input_layernorm.weight)


def test_expert_parallel_ranks_hold_whole_experts(tmp_path_factory):
    d = checkpoint(tmp_path_factory, "moe-int4")
    full = load_model(d).model
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(0))
    for r in range(2):
        shard = load_shard(d, Shard(r, 2, moe_parallel="expert"))
        for i, layer in enumerate(shard.model.layers):
            experts, ref = layer.block_sparse_moe.experts, full.model.layers[i].block_sparse_moe.experts
            for e in range(4):
                if e // 2 == r:  # experts [2r, 2r + 2) live on rank r
                    assert torch.equal(experts[e](x), ref[e](x))
                else:
                    assert isinstance(experts[e], Placeholder)


def test_float_parts_take_the_requested_dtype(tmp_path_factory):
    """A quantized shard in bf16: embeddings, norms and the LM head cast, the quantized buffers kept
    in their stored formats, as load_model does for the unsharded checkpoint."""
    d = checkpoint(tmp_path_factory, "gptq-int4")
    want = {n: t.dtype for n, t in load_model(d, dtype=torch.bfloat16).model.state_dict().items()}
    got = {n: t.dtype for n, t in load_shard(d, Shard(1, 2), dtype=torch.bfloat16).state_dict().items()}
    assert got.keys() <= want.keys() and got == {n: want[n] for n in got}
    assert got["model.norm.weight"] == torch.bfloat16 and got["lm_head.weight"] == torch.bfloat16
    assert got["model.layers.0.self_attn.o_proj.qweight"] == torch.uint8


def test_int4_split_across_a_group_is_refused_clearly(tmp_path_factory):
    """Called directly (no ParallelConfig.check_model first), load_shard still names the problem."""
    d = checkpoint(tmp_path_factory, "int4-misaligned")
    with pytest.raises(ValueError, match=r"down_proj: its 96 int4 inputs split 2 ways are 48 columns, not whole"):
        load_shard(d, Shard(0, 2))


def test_expert_parallel_int4_needs_no_split_of_the_expert_widths():
    """Whole experts per rank: an intermediate size that T would cut mid-group is fine."""
    from baton.common.config import ModelConfig
    from baton.serve.parallel.config import ParallelConfig

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    ParallelConfig(tensor_parallel_size=2, moe_parallel="expert").check_model(cfg, group_size=32)
    with pytest.raises(ValueError, match="MLP input"):
        ParallelConfig(tensor_parallel_size=2, moe_parallel="tensor").check_model(cfg, group_size=32)


def test_auto_moe_split_is_expert_parallel_when_the_ranks_divide_the_experts():
    from baton.common.config import ModelConfig
    from baton.serve.parallel.config import ParallelConfig

    moe = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    assert ParallelConfig(tensor_parallel_size=2).moe_mode(ModelConfig(**moe, num_local_experts=4)) == "expert"
    assert ParallelConfig(tensor_parallel_size=4).moe_mode(ModelConfig(**moe, num_local_experts=6)) == "tensor"
    assert (
        ParallelConfig(tensor_parallel_size=2, moe_parallel="tensor").moe_mode(ModelConfig(**moe, num_local_experts=4))
        == "tensor"
    )
