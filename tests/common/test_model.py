"""The plain model and its pluggable attention core, against naive float64 formulas."""

import math

import torch

from baton.common.config import ModelConfig
from baton.common.model import DecoderLayer, DenseCausalAttention, build_model, fuse_residual_norms
from baton.common.rope import inv_frequencies

CFG = dict(
    vocab_size=101,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    initializer_range=0.1,
)


def naive_attention(q, k, v, scale, window=None):
    """softmax(q k^T) v in float64 with explicit loops over the GQA head mapping."""
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    out = torch.empty(b, s, hq, d, dtype=torch.float64)
    for h in range(hq):
        qh, kh, vh = q[:, :, h].double(), k[:, :, h // group].double(), v[:, :, h // group].double()
        scores = qh @ kh.transpose(1, 2) * scale
        for i in range(s):
            for j in range(s):
                if j > i or (window is not None and i - j >= window):
                    scores[:, i, j] = -math.inf
        out[:, :, h] = torch.softmax(scores, -1) @ vh
    return out


class Layer:
    def __init__(self, scale, window):
        self.scaling, self.sliding_window, self.layer_idx = scale, window, 0


def test_dense_backend_matches_naive_attention_gqa_and_window():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 11, 6, 8), torch.randn(2, 11, 2, 8), torch.randn(2, 11, 2, 8)
    for window in (None, 4, 11, 50):
        out = DenseCausalAttention()(q, k, v, Layer(0.3, window))
        assert torch.allclose(out.double(), naive_attention(q, k, v, 0.3, window), atol=1e-5), window


def test_backend_is_supplied_from_outside():
    """A recording backend sees every layer in order and, computing naively, gives the same logits."""
    model = build_model(ModelConfig(**CFG, sliding_window=5), seed=0)
    calls = []

    def naive_backend(q, k, v, layer):
        calls.append((layer.layer_idx, tuple(q.shape), tuple(k.shape)))
        return naive_attention(q, k, v, layer.scaling, layer.sliding_window).to(q.dtype)

    tokens = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        ref = model(tokens)
        out = model(tokens, attn=naive_backend)
    assert calls == [(0, (2, 9, 6, 8), (2, 9, 2, 8)), (1, (2, 9, 6, 8), (2, 9, 2, 8))]
    assert (out - ref).abs().max() < 1e-5


def test_causal_and_position_offsets():
    model = build_model(ModelConfig(**CFG), seed=0)
    a = torch.randint(0, 101, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 101
    with torch.no_grad():
        la, lb = model(a), model(b)
        assert torch.equal(la[0, :8], lb[0, :8]), "a later token changed an earlier logit"
        assert not torch.allclose(la[0, 8:], lb[0, 8:])
        # RoPE depends only on relative positions: shifting all positions keeps the logits.
        shifted = model(a, positions=torch.arange(12).unsqueeze(0) + 1000)
    assert (shifted - la).abs().max() < 1e-3


def test_moe_routes_each_token_to_top_k_experts():
    model = build_model(ModelConfig(**CFG, num_local_experts=4, num_experts_per_tok=2), seed=0)
    moe = model.model.layers[0].block_sparse_moe
    x = torch.randn(5, 48)
    with torch.no_grad():
        out = moe(x)
        probs = torch.softmax(moe.gate(x), -1)
        for t in range(5):
            w, idx = probs[t].topk(2)
            expected = sum(wi / w.sum() * moe.experts[int(e)](x[t]) for wi, e in zip(w, idx))
            assert torch.allclose(out[t], expected, atol=1e-6)


def test_rope_llama3_scaling_against_formula():
    cfg = ModelConfig(
        **CFG,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    inv = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).double()
    base = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).double() / 8)
    for f, b in zip(inv.tolist(), base.tolist()):
        wavelen = 2 * math.pi / b
        if wavelen < 64 / 4:
            expected = b
        elif wavelen > 64 / 1:
            expected = b / 8
        else:
            s = (64 / wavelen - 1) / (4 - 1)
            expected = (1 - s) * b / 8 + s * b
        assert math.isclose(f, expected, rel_tol=1e-6)


def test_training_step_reduces_loss():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**CFG), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, 101, (4, 17))
    losses = []
    for _ in range(10):
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 101), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.8


def test_fused_residual_norm_gives_the_same_logits_bit_for_bit():
    """fuse_residual_norms moves the attention residual add into the post-attention norm: the same
    sum, so the same logits to the bit (dense and MoE), and only when asked for."""
    for extra in ({}, dict(num_local_experts=4, num_experts_per_tok=2)):
        cfg = ModelConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            **extra,
        )
        model = build_model(cfg, seed=0).eval()
        ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            plain = model(ids)
            assert not any(m.fuse_residual_norm for m in model.modules() if isinstance(m, DecoderLayer))
            fused = fuse_residual_norms(model)(ids)
        assert all(m.fuse_residual_norm for m in model.modules() if isinstance(m, DecoderLayer))
        torch.testing.assert_close(fused, plain, rtol=0, atol=0)
