"""Recomputation changes memory, never numbers: none / selective / full give bit-identical
gradients, and keep less for the backward pass in that order."""

import pytest
import torch

from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.train.backends import lm_loss
from baton.train.config import RecomputeConfig
from baton.train.recompute import EagerAttention, SelectiveRecompute, activation_bytes, apply_recompute

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
MODES = [RecomputeConfig("none"), RecomputeConfig("selective"), RecomputeConfig("full"), RecomputeConfig("full", 2)]


def setup(mode: RecomputeConfig, eager: bool):
    model = build_model(CFG, seed=0)
    # eager: the unfused attention core that Megatron's selective recomputation targets
    attn = apply_recompute(model, mode, "eager" if eager else "sdpa")
    if eager:
        assert isinstance(attn, SelectiveRecompute if mode.mode == "selective" else EagerAttention)
    return model, attn


@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_all_modes_give_identical_gradients(eager):
    batch = torch.randint(0, 64, (2, 129), generator=torch.Generator().manual_seed(0))
    grads = []
    for mode in MODES:
        model, attn = setup(mode, eager)
        lm_loss(model(batch[:, :-1], attn=attn), batch).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for other in grads[1:]:
        assert all(torch.equal(other[n], grads[0][n]) for n in grads[0])


def test_activation_memory_falls_from_none_to_selective_to_full():
    batch = torch.randint(0, 64, (2, 257), generator=torch.Generator().manual_seed(0))

    def measure(mode: RecomputeConfig, eager: bool) -> int:
        model, attn = setup(mode, eager)
        return activation_bytes(lambda: lm_loss(model(batch[:, :-1], attn=attn), batch))

    none, selective, full, half = (measure(m, eager=True) for m in MODES)
    s, a, b = 256, CFG.num_attention_heads, 2
    scores = b * a * s * s * 4  # one fp32 [b, a, s, s] tensor
    assert none - selective >= scores * CFG.num_hidden_layers  # the softmax output of every layer
    assert full < selective < none and full < half < none
    # torch's fused SDPA keeps no s x s tensors: selective then recomputes the norms and SwiGLU activations,
    # freeing at least silu(gate) [b, s, intermediate] and each norm's x * rstd [b, s, h] in every layer.
    sdpa_none, sdpa_selective = measure(MODES[0], eager=False), measure(MODES[1], eager=False)
    elementwise = b * s * (CFG.intermediate_size + 2 * CFG.hidden_size) * 4 * CFG.num_hidden_layers
    assert sdpa_none - sdpa_selective >= elementwise
