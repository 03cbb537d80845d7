"""MoE router losses and routing in one process: the losses equal a hand computation and HF's
load_balancing_loss_func; the injected gradient equals that of an explicit total loss; experts
that get no tokens get zero (not missing) gradients; the logs see the values; bad MoE recipes
and layouts fail with a ConfigError before any work.

The multi-process equivalence (DDP, FSDP2, EP) is tests/train/parallel/test_expert_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from baton.common.config import ConfigError, ModelConfig
from baton.common.model import build_model
from baton.common.moe import MoE
from baton.train.moe import attach_router_losses, load_balancing_loss, router_metrics, router_z_loss
from baton.train.parallel.layout import ParallelConfig, check_layout
from baton.train.recipe import config_from_dict

MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
    num_local_experts=8,
    num_experts_per_tok=2,
)


def test_losses_match_a_hand_computation_and_hf():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 8, generator=g) * 2
    chosen = torch.topk(logits.softmax(-1), 2, dim=-1).indices
    # By hand: f_i = slots routed to i / tokens, P_i = mean softmax probability, loss = E sum f_i P_i.
    probs = [[float(v) for v in row] for row in logits.softmax(-1)]
    f = [sum(int(e in row) for row in chosen.tolist()) / 12 for e in range(8)]
    p = [sum(row[e] for row in probs) / 12 for e in range(8)]
    by_hand = 8 * sum(fi * pi for fi, pi in zip(f, p))
    assert load_balancing_loss(logits, chosen, 8).item() == pytest.approx(by_hand, rel=1e-6)
    assert load_balancing_loss(logits, chosen, 8).item() == pytest.approx(
        load_balancing_loss_func((logits,), num_experts=8, top_k=2).item(), rel=1e-6
    )
    lse = [torch.tensor(row).exp().sum().log().item() for row in logits.tolist()]
    assert router_z_loss(logits).item() == pytest.approx(sum(v * v for v in lse) / 12, rel=1e-6)
    # Perfect balance (each expert 2 of the 16 slots, uniform probabilities) gives k = 2.
    assert load_balancing_loss(torch.zeros(8, 8), torch.arange(16).view(8, 2) % 8, 8).item() == pytest.approx(2.0)


def test_injected_gradient_equals_the_explicit_total_loss():
    """backward(CE) with the router losses attached == backward(CE + mean over layers of
    coef x losses), computed by hand from the router logits, for every parameter."""
    aux, z, micro = 0.05, 0.01, 2
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    model = build_model(MODEL, seed=0)
    attach_router_losses(model, aux, z, micro)
    (F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()) / micro).backward()
    injected = {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = build_model(MODEL, seed=0)
    logits_out: list[torch.Tensor] = []
    hooks = [
        m.gate.register_forward_hook(lambda _m, _i, out: logits_out.append(out))
        for m in ref.modules()
        if isinstance(m, MoE)
    ]
    ce = F.cross_entropy(ref(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    for h in hooks:
        h.remove()
    router = sum(
        aux * load_balancing_loss(lg, torch.topk(lg.softmax(-1), 2, -1).indices, 8) + z * router_z_loss(lg)
        for lg in logits_out
    ) / len(logits_out)
    ((ce + router) / micro).backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(injected[n], p.grad, rtol=1e-5, atol=1e-8, msg=n)
    # The router losses do move the router: without them its gradient differs.
    plain = build_model(MODEL, seed=0)
    (F.cross_entropy(plain(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()) / micro).backward()
    gate = "model.layers.0.block_sparse_moe.gate.weight"
    assert not torch.allclose(plain.get_parameter(gate).grad, injected[gate], rtol=1e-3)


def test_zero_token_experts_get_zero_gradients_and_are_logged():
    """One token, top-2 of 8 experts: six experts per layer get no token. Their parameters still
    get a gradient (zeros) - what DDP and FSDP2 need - and the logs count them."""
    model = build_model(MODEL, seed=0)
    attach_router_losses(model, 0.01, 0.001, 1)
    tokens = torch.tensor([[3, 5]])
    model(tokens[:, :1]).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
    zero_experts = [
        n for n, p in model.named_parameters() if ".experts." in n and n.endswith("w1.weight") and not p.grad.any()
    ]
    assert len(zero_experts) == 2 * 6, zero_experts
    logged = router_metrics(model)
    assert logged["moe_zero_token_experts"] == 12
    assert logged["moe_aux_loss"] > 0 and logged["moe_z_loss"] > 0
    assert router_metrics(model) == {}  # read once: the sums start again
    with torch.no_grad():  # serving / eval: nothing recorded, empty experts skipped
        model(tokens)
    assert router_metrics(model) == {}


def test_router_losses_leave_the_forward_unchanged():
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    a, b = build_model(MODEL, seed=0), build_model(MODEL, seed=0)
    attach_router_losses(b, 0.5, 0.5, 1)
    assert torch.equal(a(tokens), b(tokens))


@pytest.mark.parametrize(
    "par, model, match",
    [
        (dict(dp=4, ep=3), MODEL, "does not divide the 8 experts"),
        (dict(dp=2, ep=4), MODEL, "does not divide the data-parallel degree dp=2"),
        (dict(dp=2, ep=2, dp_mode="ddp"), MODEL, "needs dp_mode fsdp"),
        (dict(dp=2, ep=2, cp=2), MODEL, "context parallelism"),
        (dict(dp=2, ep=2), ModelConfig(**{**MODEL.__dict__, "num_local_experts": 0, "model_type": "llama"}), "MoE"),
        (dict(dp=2, ep=0), MODEL, "ep must be a positive integer"),
    ],
)
def test_bad_ep_layouts_fail_before_work(par, model, match):
    world = ParallelConfig(**par).dp * ParallelConfig(**par).cp
    with pytest.raises(ConfigError, match=match):
        check_layout(ParallelConfig(**par), model, world, 1, 16)


def test_moe_recipe_section_is_checked():
    moe_model = {"preset": "demo", "num_local_experts": 4, "model_type": "mixtral"}
    cfg = config_from_dict({"model": moe_model, "moe": {"aux_loss_coef": 0.02, "z_loss_coef": 0.0}})
    assert (cfg.moe.aux_loss_coef, cfg.moe.z_loss_coef) == (0.02, 0.0)
    with pytest.raises(ConfigError, match="moe.aux_loss_coef must be a number >= 0"):
        config_from_dict({"moe": {"aux_loss_coef": -1}})
    with pytest.raises(ConfigError, match="unknown key"):
        config_from_dict({"moe": {"aux_coef": 0.1}})
    with pytest.raises(ConfigError, match="precision fp16 with MoE router losses"):
        config_from_dict({"model": moe_model, "precision": "fp16"})
    config_from_dict({"model": moe_model, "precision": "fp16", "moe": {"aux_loss_coef": 0, "z_loss_coef": 0}})
