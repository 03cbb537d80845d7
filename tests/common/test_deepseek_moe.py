"""DeepSeekMoE (common/deepseek_moe.py) against transformers' DeepseekV3MoE: outputs, routing and
gradients in float32, loaded through the names transformers' save_pretrained writes; the
auxiliary-loss-free bias update and the sequence-wise balance loss against the paper's formulas."""

from __future__ import annotations

import pytest
import torch
import transformers
from baton.common.config import ModelConfig
from baton.common.deepseek_moe import DeepSeekMoE
from baton.common.moe import build_moe
from transformers.core_model_loading import revert_weight_conversion

H, INTER = 32, 16  # (multiples of 4: F.grouped_mm's 16-byte strides in float32)
PREFIX = "model.layers.0.mlp."
# (experts, top-k, n_group, topk_group, norm_topk_prob, routed_scaling_factor, n_shared_experts)
CASES = [
    (8, 2, 1, 1, True, 1.0, 1),
    (8, 3, 4, 2, True, 2.5, 1),
    (16, 4, 4, 1, False, 0.7, 2),
    (12, 2, 2, 2, True, 1.8, 1),
    (64, 8, 8, 4, True, 2.5, 1),
]


def routing(experts: int, top_k: int, n_group: int, topk_group: int, norm: bool, scale: float, shared: int) -> dict:
    return dict(
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
        n_shared_experts=shared,
    )


def baton_config(experts: int, *case) -> ModelConfig:
    return ModelConfig(
        model_type="deepseek_v3",
        vocab_size=64,
        hidden_size=H,
        intermediate_size=48,
        moe_intermediate_size=INTER,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_local_experts=experts,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        **routing(experts, *case),
    )


def hf_pair(case: tuple, seed: int = 0) -> tuple[torch.nn.Module, DeepSeekMoE]:
    """transformers' DeepseekV3MoE with random weights and a nonzero correction bias, and ours loaded
    (strictly) from the tensors save_pretrained writes for it."""
    experts = case[0]
    cfg = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=48,
        moe_intermediate_size=INTER,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=experts,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        experts_implementation="eager",
        **routing(*case),
    )
    model = transformers.DeepseekV3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    hf = model.model.layers[0].mlp
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        hf.gate.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.1)
    on_disk = revert_weight_conversion(model, dict(model.state_dict()))  # what save_pretrained writes
    ours = DeepSeekMoE(baton_config(*case))
    ours.load_state_dict({k.removeprefix(PREFIX): v for k, v in on_disk.items() if k.startswith(PREFIX)}, strict=True)
    return hf.eval(), ours


def tokens(b: int, s: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, s, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_equals_transformers_loop_and_grouped(case, monkeypatch):
    hf, ours = hf_pair(case)
    x = tokens(2, 24)
    calls = []
    kernel = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    with torch.no_grad():
        _, hf_weights, hf_chosen = hf.gate(x)
        weights, chosen = ours.route(ours.router_logits(x.reshape(-1, H)))
        assert torch.equal(chosen.sort(-1).values, hf_chosen.sort(-1).values)
        assert torch.allclose(weights.gather(1, chosen.argsort(-1)), hf_weights.gather(1, hf_chosen.argsort(-1)))
        ref = hf(x)
        loop = ours(x)
        assert calls == []  # (not packed: the per-expert loop)
        assert ours.pack()  # every held expert's weights in two stacked tensors: the grouped GEMM
        grouped = ours(x)
    assert len(calls) == 2  # gate_up, then down
    torch.testing.assert_close(loop, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped, ref, rtol=1e-5, atol=1e-5)


def test_gradients_equal_transformers_and_never_reach_the_bias():
    hf, ours = hf_pair(CASES[1], seed=3)
    x = tokens(2, 16, seed=4)
    r = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(5))
    for block in (hf, ours):
        (block(x) * r).sum().backward()
    torch.testing.assert_close(ours.gate.weight.grad, hf.gate.weight.grad, rtol=1e-5, atol=1e-5)
    assert ours.gate.weight.grad.abs().sum() > 0
    gate_up = torch.stack([torch.cat([e.gate_proj.weight.grad, e.up_proj.weight.grad]) for e in ours.experts])
    down = torch.stack([e.down_proj.weight.grad for e in ours.experts])
    torch.testing.assert_close(gate_up, hf.experts.gate_up_proj.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(down, hf.experts.down_proj.grad, rtol=1e-5, atol=1e-5)
    for name in ("gate_proj", "up_proj", "down_proj"):
        mine, theirs = getattr(ours.shared_experts, name).weight.grad, getattr(hf.shared_experts, name).weight.grad
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    bias = ours.gate.e_score_correction_bias
    assert not bias.requires_grad and bias.grad is None
    assert "gate.e_score_correction_bias" not in dict(ours.named_parameters())


def test_bias_stays_float32_and_routing_stays_transformers_in_bfloat16():
    hf, ours = hf_pair(CASES[1], seed=6)
    bias = ours.gate.e_score_correction_bias.clone()
    ours.to(torch.bfloat16)
    assert ours.gate.weight.dtype == torch.bfloat16
    assert ours.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(ours.gate.e_score_correction_bias, bias)  # moved, not rounded
    assert ours.state_dict()["gate.e_score_correction_bias"].dtype == torch.float32
    # transformers' bf16 model keeps gate.weight in float32; from a bf16-representable gate (as any
    # bf16 checkpoint's) the routing is the same.
    with torch.no_grad():
        hf.gate.weight.copy_(ours.gate.weight.float())
        x = tokens(1, 32, seed=7).bfloat16()
        _, hf_weights, hf_chosen = hf.gate(x)
        weights, chosen = ours.route(ours.router_logits(x.reshape(-1, H)))
    assert torch.equal(chosen.sort(-1).values, hf_chosen.sort(-1).values)
    assert torch.allclose(weights.gather(1, chosen.argsort(-1)), hf_weights.gather(1, hf_chosen.argsort(-1)))
    assert ours(x).dtype == torch.bfloat16


def test_load_is_recorded_with_gradients_and_update_bias_follows_the_sign_rule():
    hf, ours = hf_pair(CASES[2], seed=8)
    x = tokens(3, 10, seed=9)
    with torch.no_grad():
        ours(x)  # eval / serving: nothing recorded
        assert ours.expert_load is None
        hf_chosen = hf.gate(x)[2]
    ours(x)
    ours(x)
    expected = 2 * torch.bincount(hf_chosen.flatten(), minlength=16)
    assert torch.equal(ours.expert_load, expected)
    before = ours.gate.e_score_correction_bias.clone()
    load = ours.update_bias(0.01)
    assert torch.equal(load, expected.float()) and ours.expert_load is None
    step = ours.gate.e_score_correction_bias - before
    mean = expected.float().mean()
    for e in range(16):  # +rate under the mean, -rate over it
        want = 0.01 if expected[e] < mean else -0.01 if expected[e] > mean else 0.0
        assert step[e].item() == pytest.approx(want, abs=1e-7)
    assert ours.update_bias(0.01) is None  # no forward since: nothing moves
    assert torch.equal(ours.gate.e_score_correction_bias, before + step)
    given = torch.tensor([5] + [1] * 14 + [1], dtype=torch.int64)  # e.g. the sum over data-parallel ranks
    ours.update_bias(0.5, given)  # mean 1.25: expert 0 over it, the rest under
    assert torch.allclose(ours.gate.e_score_correction_bias - before - step, torch.tensor([-0.5] + [0.5] * 15))


def paper_sequence_loss(logits: torch.Tensor, chosen: torch.Tensor, b: int, k: int) -> float:
    """DeepSeek-V3 eq. 17-20 token by token in float64, averaged over the b sequences."""
    e = logits.shape[-1]
    t = logits.shape[0] // b
    s = logits.double().sigmoid()
    total = 0.0
    for seq in range(b):
        rows = range(seq * t, (seq + 1) * t)
        f = [e / (k * t) * sum(int(i in chosen[r].tolist()) for r in rows) for i in range(e)]
        p = [sum((s[r, i] / s[r].sum()).item() for r in rows) / t for i in range(e)]
        total += sum(fi * pi for fi, pi in zip(f, p))
    return total / b


def test_sequence_balance_loss_is_the_papers_and_reaches_the_router_through_its_hook():
    _, ours = hf_pair(CASES[1], seed=10)
    x = tokens(3, 8, seed=11)
    seen = []

    def hook(module, out, loss):
        seen.append(loss)
        return out

    ours.seq_loss = hook
    ours(x)
    with torch.no_grad():
        logits = ours.router_logits(x.reshape(-1, H))
        chosen = ours.route(logits)[1]
    (loss,) = seen
    assert loss.item() == pytest.approx(paper_sequence_loss(logits, chosen, 3, ours.top_k), rel=1e-5)
    # Per sequence, not over the batch: the same tokens as one sequence give another value.
    assert ours.sequence_balance_loss(logits, chosen, 1).item() != pytest.approx(loss.item(), rel=1e-3)
    loss.backward()
    assert ours.gate.weight.grad.abs().sum() > 0
    with torch.no_grad():
        ours(x)
    assert len(seen) == 1  # no gradients: not computed


def test_bias_evens_out_a_skewed_router():
    """A frozen router whose logits are shifted by up to +-2.4 per expert on every token: 300 steps
    of update_bias (rate 0.01, 256 fresh random tokens each) bring the load's coefficient of
    variation from 1.37 to 0.070 (19.6x) and max/min load from 149 to 1.18 (measured on 8192 fresh
    tokens; asserted: down 10x, and under 1.5)."""
    ours = DeepSeekMoE(baton_config(8, 2, 2, 1, True, 1.0, 1))
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(H, generator=gen)
    with torch.no_grad():
        ours.gate.weight.copy_(torch.randn(8, H, generator=gen) * 0.3)
        ours.gate.weight += torch.linspace(-2.4, 2.4, 8)[:, None] * mean / mean.norm() ** 2
    ours.requires_grad_(False)

    def load() -> torch.Tensor:
        with torch.no_grad():
            x = torch.randn(8192, H, generator=gen) + mean
            return torch.bincount(ours.route(ours.router_logits(x))[1].flatten(), minlength=8).float()

    def cv(load: torch.Tensor) -> float:
        return (load.std() / load.mean()).item()

    before = load()
    for _ in range(300):
        ours(torch.randn(1, 256, H, generator=gen) + mean)  # (gradients on: the load is recorded)
        ours.update_bias(0.01)
    after = load()
    assert cv(before) > 1.2 and before.max() / before.min() > 100
    assert cv(after) < cv(before) / 10
    assert after.max() / after.min() < 1.5


def test_switch_router_losses_are_refused_and_build_moe_points_here():
    _, ours = hf_pair(CASES[0])
    assert ours.router_loss is None
    with pytest.raises(TypeError, match="sigmoid affinities"):
        ours.router_loss = lambda module, out, logits, chosen: out
    ours.router_loss = None
    with pytest.raises(ValueError, match="DeepSeekMoE"):
        build_moe(baton_config(*CASES[0]))
