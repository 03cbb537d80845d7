"""Qwen3-MoE's and gpt-oss's MoE blocks against transformers' own, the grouped GEMM against the
per-expert loop, and MXFP4 dequantization against transformers' dequantizer."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from baton.common.config import ModelConfig
from baton.common.hf import normalize_hf_state_dict
from baton.common.moe import GptOssMoE, MoE, build_moe, pack_experts
from baton.common.mxfp4 import dequantize_expert_weight, dequantize_state_dict
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

H, INTER = 32, 16  # hidden and expert widths (multiples of 4: F.grouped_mm's 16-byte strides in float32)
PREFIX = "model.layers.0.mlp."
CASES = [(4, 1), (4, 2), (64, 8)]  # (experts, top-k)


def baton_config(model_type: str, experts: int, top_k: int, **kw) -> ModelConfig:
    if model_type == "qwen3_moe":
        kw = {"intermediate_size": 48, "moe_intermediate_size": INTER, **kw}
    else:
        kw = {"intermediate_size": INTER, **kw}
    return ModelConfig(
        model_type=model_type,
        vocab_size=64,
        hidden_size=H,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        **kw,
    )


def random_(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def hf_block(model_type: str, experts: int, top_k: int, norm_topk_prob: bool = True) -> torch.nn.Module:
    common = dict(hidden_size=H, num_experts_per_tok=top_k, experts_implementation="eager")
    if model_type == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            moe_intermediate_size=INTER, num_experts=experts, norm_topk_prob=norm_topk_prob, **common
        )
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        block = GptOssMLP(transformers.GptOssConfig(intermediate_size=INTER, num_local_experts=experts, **common))
    random_(block, seed=experts * 10 + top_k)
    return block.eval()


def baton_block(model_type: str, hf: torch.nn.Module, experts: int, top_k: int, **kw) -> MoE:
    """Baton's block with `hf`'s weights, loaded through the checkpoint-name normalization."""
    cfg = baton_config(model_type, experts, top_k, **kw)
    state = normalize_hf_state_dict({PREFIX + k: v for k, v in hf.state_dict().items()}, cfg)
    block = build_moe(cfg)
    block.load_state_dict({k.removeprefix(PREFIX): v for k, v in state.items()}, strict=True)
    return block.eval()


def hf_forward(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, n, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("experts,top_k", CASES)
def test_block_matches_transformers(model_type, experts, top_k):
    hf = hf_block(model_type, experts, top_k)
    kw = {"norm_topk_prob": True} if model_type == "qwen3_moe" else {}  # (Qwen3-MoE's default: False)
    ours = baton_block(model_type, hf, experts, top_k, **kw)
    assert pack_experts(ours) == 1
    ours.cpu_min_slots_per_expert = 0.0
    x = tokens(37)
    with torch.no_grad():
        ref = hf_forward(hf, x)
        for grouped in (True, False):
            ours.grouped = grouped
            err = (ours(x) - ref).abs().max().item()
            assert err < 1e-5, f"{model_type} E={experts} k={top_k} grouped={grouped}: {err:.2e}"
    assert ref.abs().max() > 0.1


def test_qwen3_routing_without_renormalisation():
    hf = hf_block("qwen3_moe", 8, 2, norm_topk_prob=False)
    ours = baton_block("qwen3_moe", hf, 8, 2, norm_topk_prob=False)
    x = tokens(20, seed=3)
    with torch.no_grad():
        assert (ours(x) - hf_forward(hf, x)).abs().max() < 1e-5


def test_checkpoint_names_are_the_families():
    qwen = build_moe(baton_config("qwen3_moe", 4, 2))
    assert {
        "gate.weight",
        "experts.3.gate_proj.weight",
        "experts.3.up_proj.weight",
        "experts.3.down_proj.weight",
    } <= set(qwen.state_dict())
    assert qwen.experts[0].gate_proj.weight.shape == (INTER, H)
    oss = build_moe(baton_config("gpt_oss", 4, 2))
    assert isinstance(oss, GptOssMoE)
    shapes = {k: tuple(v.shape) for k, v in oss.state_dict().items()}
    assert shapes == {
        "router.weight": (4, H),
        "router.bias": (4,),
        "experts.gate_up_proj": (4, H, 2 * INTER),
        "experts.gate_up_proj_bias": (4, 2 * INTER),
        "experts.down_proj": (4, INTER, H),
        "experts.down_proj_bias": (4, H),
    }


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_grouped_equals_loop_with_empty_experts_and_one_token(model_type, monkeypatch):
    calls = []
    kernel = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    block = build_moe(baton_config(model_type, 16, 2))
    random_(block, seed=1)
    assert pack_experts(block) == 1
    block.cpu_min_slots_per_expert = 0.0  # grouped however few the tokens (by default: the loop below 1 per expert)
    for n in (1, 3, 64):  # 1 and 3 tokens leave most experts without a token
        x = tokens(n, seed=n)
        with torch.no_grad():
            block.grouped = False
            loop = block(x)
            block.grouped = True
            calls.clear()
            grouped = block(x)
        assert len(calls) == 2, "the grouped path ran torch's grouped GEMM (gate/up, then down)"
        assert torch.allclose(grouped, loop, atol=1e-5, rtol=1e-5), (model_type, n)
        assert grouped.shape == x.shape


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_packing_keeps_names_and_values_and_follows_moves(model_type):
    block = build_moe(baton_config(model_type, 4, 2))
    random_(block, seed=2)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    assert block.pack()
    after = block.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    experts = block.held_experts()
    assert block.packed_weights(experts) is not None

    def grouped_equals_loop(x: torch.Tensor) -> None:
        with torch.no_grad():
            block.grouped = False
            ref = block(x)
            block.grouped = True
            assert torch.allclose(block(x), ref, atol=1e-6)

    block.to(torch.float64)  # new storage per parameter: packed again, in float64
    gate_up, down = block.packed_weights(experts)
    assert gate_up.dtype == down.dtype == torch.float64
    grouped_equals_loop(tokens(5).double())
    block.float()
    block.load_state_dict(before)  # in place: still packed, with the loaded values
    assert block.packed_weights(experts) is not None
    grouped_equals_loop(tokens(9))
    block.load_state_dict(before, assign=True)  # new tensors: no longer packed, the loop runs
    assert block.packed_weights(experts) is None
    grouped_equals_loop(tokens(9))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_cpu_decode_runs_the_loop_and_prefill_grouped(model_type, monkeypatch):
    calls = []
    kernel = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    block = build_moe(baton_config(model_type, 16, 2))
    block.pack()
    with torch.no_grad():
        block(tokens(1))  # 2 token-slots for 16 experts
        assert calls == []
        block(tokens(8))  # 16
        assert len(calls) == 2


def test_gpt_oss_gradients_grouped_equal_loop():
    block = build_moe(baton_config("gpt_oss", 8, 2))
    random_(block, seed=4)
    x = tokens(11, seed=5)
    grads = []
    for grouped in (True, False):
        block.zero_grad()
        block.grouped = grouped
        block(x).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in block.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-4, rtol=1e-4), name


def test_training_keeps_the_loop_for_module_experts():
    """With gradients Mixtral/Qwen3-MoE run each expert module (expert parallelism's FSDP units and
    recomputation hook them), even a packed block, and every expert gets a gradient."""
    block = build_moe(baton_config("qwen3_moe", 8, 2))
    random_(block, seed=6)
    block.pack()
    calls = []
    for e in block.experts:
        e.register_forward_hook(lambda m, a, o: calls.append(m))
    block(tokens(2)).sum().backward()
    assert len(calls) == 8
    assert all(p.grad is not None for p in block.parameters())


def test_mxfp4_dequantization_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    experts, rows, groups = 3, 12, 4
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (experts, rows, groups), dtype=torch.uint8, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        ours = dequantize_expert_weight(blocks, scales, dtype)
        assert ours.shape == (experts, groups * 32, rows) and ours.dtype == dtype
        assert torch.equal(ours, ref)


def test_mxfp4_checkpoint_imports_as_the_bf16_layout():
    """A gpt-oss hub state dict (experts as blocks/scales) normalizes to the bf16 names, in the dtype
    of the other weights, and the block computes with them."""
    gen = torch.Generator().manual_seed(1)
    e, i = 4, 64  # MXFP4 blocks run along the input dimension: H and INTER multiples of 32
    cfg = baton_config("gpt_oss", e, 2, intermediate_size=i)

    def quantized(rows: int, cols: int) -> dict[str, torch.Tensor]:
        return {
            "blocks": torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=gen),
            "scales": torch.randint(120, 128, (e, rows, cols // 32), dtype=torch.uint8, generator=gen),
        }

    packed = {f"experts.gate_up_proj_{k}": v for k, v in quantized(2 * i, H).items()}
    packed |= {f"experts.down_proj_{k}": v for k, v in quantized(H, i).items()}
    dense = {
        "router.weight": torch.randn(e, H, generator=gen).bfloat16(),
        "router.bias": torch.randn(e, generator=gen).bfloat16(),
        "experts.gate_up_proj_bias": torch.randn(e, 2 * i, generator=gen).bfloat16(),
        "experts.down_proj_bias": torch.randn(e, H, generator=gen).bfloat16(),
    }
    state = normalize_hf_state_dict({PREFIX + k: v for k, v in {**packed, **dense}.items()}, cfg)
    assert not any(k.endswith(("_blocks", "_scales")) for k in state)
    for proj in ("gate_up_proj", "down_proj"):
        ref = convert_moe_packed_tensors(packed[f"experts.{proj}_blocks"], packed[f"experts.{proj}_scales"])
        assert state[PREFIX + f"experts.{proj}"].dtype == torch.bfloat16
        assert torch.equal(state[PREFIX + f"experts.{proj}"], ref), proj
    block = build_moe(cfg).bfloat16()
    block.load_state_dict({k.removeprefix(PREFIX): v for k, v in state.items()}, strict=True)
    with torch.no_grad():
        assert torch.isfinite(block(tokens(4).bfloat16())).all()


def test_mxfp4_needs_both_halves():
    with pytest.raises(ValueError, match="blocks and scales"):
        dequantize_state_dict(
            {"x.experts.down_proj_blocks": torch.zeros(1, 2, 1, 16, dtype=torch.uint8)}, torch.float32
        )


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_router_aux_loss_is_transformers_load_balancing_loss(model_type):
    """baton.train.moe's per-layer load-balancing loss is HF's load_balancing_loss_func on that layer's
    router logits (gpt-oss's include the router bias), and it reaches the router's gradients."""
    from baton.train.moe import attach_router_losses, load_balancing_loss, router_metrics

    hf_loss = importlib.import_module(
        f"transformers.models.{model_type}.modeling_{model_type}"
    ).load_balancing_loss_func
    block = build_moe(baton_config(model_type, 8, 2))
    random_(block, seed=7)
    x = tokens(24, seed=8).reshape(-1, H)
    logits = block.router_logits(x)
    _, chosen = block.route(logits)
    ours = load_balancing_loss(logits, chosen, 8)
    assert torch.allclose(ours, hf_loss((logits,), 8, 2), atol=1e-6)

    assert attach_router_losses(block, aux_coef=1.0, z_coef=0.0, micro_batches=1) == 1
    block(x).sum().backward()
    router = block.router if model_type == "gpt_oss" else block.gate
    with_aux = router.weight.grad.clone()
    block.zero_grad()
    block.router_loss = None
    block(x).sum().backward()
    assert not torch.allclose(with_aux, router.weight.grad)
    assert set(router_metrics(block)) == {"moe_aux_loss", "moe_z_loss", "moe_zero_token_experts"}
