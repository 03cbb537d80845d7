"""The references themselves against naive float64 formulas written straight from the definitions."""

import math

import pytest
import torch
import torch.nn.functional as F

from baton.kernels import quant, reference as ref
from baton.common.rope import inv_frequencies, rotary_cos_sin

f64 = torch.float64


def _naive_attention(q, k, v, cu_q, cu_k, causal, window, scale):
    """Per (sequence, head, query): softmax over the keys the definition allows, in float64."""
    out = torch.zeros_like(q, dtype=f64)
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for h in range(q.shape[1]):
            for i in range(q_len):
                pos = k_len - q_len + i
                keys = [j for j in range(k_len) if (not causal or j <= pos) and (window is None or pos - j < window)]
                if not keys:
                    continue
                kk = k[cu_k[b] + torch.tensor(keys), h // group].double()
                w = torch.softmax(kk @ q[cu_q[b] + i, h].double() * scale, 0)
                out[cu_q[b] + i, h] = w @ v[cu_k[b] + torch.tensor(keys), h // group].double()
    return out


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 4)])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1)])
def test_attention_ref_matches_naive(causal, window, heads):
    lens_q, lens_k = [1, 6, 9], [3, 6, 13]  # includes q_len < k_len (bottom-right causal)
    cu_q, cu_k = [0, 1, 7, 16], [0, 3, 9, 22]
    q = torch.randn(sum(lens_q), heads[0], 8, dtype=f64)
    k, v = torch.randn(2, sum(lens_k), heads[1], 8, dtype=f64)
    got = ref.flash_attn_varlen_ref(
        q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), 9, 13, causal=causal, sliding_window=window, softmax_scale=0.3
    )
    torch.testing.assert_close(got, _naive_attention(q, k, v, cu_q, cu_k, causal, window, 0.3), rtol=1e-12, atol=1e-12)


def test_attention_ref_row_without_keys_is_zero():
    q = torch.randn(3, 1, 8, dtype=f64)
    k = torch.randn(1, 1, 8, dtype=f64)
    out = ref.flash_attn_varlen_ref(q, k, k, torch.tensor([0, 3]), torch.tensor([0, 1]), 3, 1)
    assert out[:2].abs().max() == 0 and out[2].abs().max() > 0


def _pools(k_seqs, v_seqs, block_size=4, num_blocks=16):
    """Scatter per-sequence K/V token lists into NaN pools through random block tables."""
    kc = torch.full((num_blocks, block_size, *k_seqs[0].shape[1:]), float("nan"), dtype=f64)
    vc = torch.full_like(kc, float("nan"))
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(k_seqs), 5, dtype=torch.int32)
    for b, (ks, vs) in enumerate(zip(k_seqs, v_seqs)):
        for t in range(ks.shape[0]):
            if t % block_size == 0:
                tables[b, t // block_size] = perm.pop()
            kc[tables[b, t // block_size], t % block_size] = ks[t]
            vc[tables[b, t // block_size], t % block_size] = vs[t]
    return kc, vc, tables


def test_paged_prefix_ref_matches_naive():
    prefix, new = [0, 5, 9], [3, 1, 4]
    k_prefix = [torch.randn(n, 2, 8, dtype=f64) for n in prefix]
    v_prefix = [torch.randn(n, 2, 8, dtype=f64) for n in prefix]
    kc, vc, tables = _pools(k_prefix, v_prefix)
    q = torch.randn(sum(new), 4, 8, dtype=f64)
    k, v = torch.randn(2, sum(new), 2, 8, dtype=f64)
    cu = torch.tensor([0, 3, 4, 8])
    got = ref.flash_attn_with_paged_prefix_ref(q, k, v, cu, kc, vc, tables, torch.tensor(prefix), 4, sliding_window=6)
    kk = torch.cat([torch.cat([k_prefix[b], k[cu[b] : cu[b + 1]]]) for b in range(3)])
    vv = torch.cat([torch.cat([v_prefix[b], v[cu[b] : cu[b + 1]]]) for b in range(3)])
    want = _naive_attention(q, kk, vv, cu.tolist(), [0, 3, 9, 22], True, 6, 8**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_decode_ref_matches_naive():
    """Decode = the last token of each context attending to the context (itself included)."""
    ctx = [1, 6, 10]
    k_seqs = [torch.randn(n, 2, 8, dtype=f64) for n in ctx]
    v_seqs = [torch.randn(n, 2, 8, dtype=f64) for n in ctx]
    kc, vc, tables = _pools(k_seqs, v_seqs)
    q = torch.randn(3, 4, 8, dtype=f64)
    got = ref.paged_attention_decode_ref(q, kc, vc, tables, torch.tensor(ctx), sliding_window=3)
    want = _naive_attention(q, torch.cat(k_seqs), torch.cat(v_seqs), [0, 1, 2, 3], [0, 1, 7, 17], True, 3, 8**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_reshape_and_cache_ref_roundtrip_with_gather():
    k, v = torch.randn(2, 6, 2, 8, dtype=f64)
    kc, vc = torch.full((2, 4, 4, 2, 8), float("nan"), dtype=f64)
    slots = torch.tensor([8, 9, -1, 10, 11, 0])  # block 2, offsets 0..3 (one token skipped), block 0
    ref.reshape_and_cache_ref(k, v, kc, vc, slots)
    torch.testing.assert_close(ref.gather_paged(kc, torch.tensor([2]), 4), k[[0, 1, 3, 4]])
    torch.testing.assert_close(vc[0, 0], v[5])
    assert torch.isnan(kc[1]).all() and torch.isnan(kc[0, 1:]).all()


def test_rms_norm_ref():
    x, r = torch.randn(2, 2, 3, 10, dtype=f64)
    w = torch.randn(10, dtype=f64)
    want = torch.tensor(
        [
            [
                [
                    (x[i, j, c] + r[i, j, c]) / math.sqrt(sum((x[i, j] + r[i, j]) ** 2) / 10 + 1e-5) * w[c]
                    for c in range(10)
                ]
                for j in range(3)
            ]
            for i in range(2)
        ],
        dtype=f64,
    )
    out, h = ref.rms_norm_ref(x, w, 1e-5, residual=r)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(h, x + r)


def test_rotary_ref_is_complex_rotation():
    """rotate_half layout: (x_i, x_{i+D/2}) is the complex number rotated by positions * inv_freq_i."""
    pos = torch.tensor([0, 3, 17, 1000])
    q, k = torch.randn(4, 3, 16, dtype=f64), torch.randn(4, 1, 16, dtype=f64)
    cos, sin = rotary_cos_sin(inv_frequencies(16, 500.0), pos, f64)
    inv_freq = 1.0 / 500.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    angle = (pos[:, None].float() * inv_freq[None, :]).double()  # fp32 angles, as the tables are built
    for x, got in zip((q, k), ref.apply_rotary_ref(q, k, cos, sin)):
        z = torch.complex(x[..., :8], x[..., 8:]) * torch.polar(torch.ones_like(angle), angle)[:, None, :]
        torch.testing.assert_close(got, torch.cat([z.real, z.imag], -1), rtol=1e-6, atol=1e-6)


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(inv_frequencies(128, 500000.0, scaling), want)


def test_swiglu_ref():
    g, u = torch.randn(2, 50, dtype=f64)
    torch.testing.assert_close(ref.swiglu_ref(g, u), g / (1 + torch.exp(-g)) * u)


def test_int4_pack_unpack_and_quantizers_bound_the_error():
    w = torch.randn(6, 64, dtype=torch.float32)
    packed, scales, zeros = quant.quantize_int4_groupwise(w, group_size=16)
    q = ref.unpack_int4(packed)
    assert all(int(packed[n, i]) == int(q[n, 2 * i]) + 16 * int(q[n, 2 * i + 1]) for n in range(6) for i in range(32))
    step = scales.repeat_interleave(16, 1)
    assert ((ref.dequantize_int4(packed, scales, zeros, 16) - w).abs() <= step * 0.5 + 1e-6).all()

    q8, s8 = quant.quantize_int8_per_channel(w)
    assert ((q8.float() * s8[:, None] - w).abs() <= s8[:, None] * 0.5 + 1e-6).all()
    f8, sf = quant.quantize_fp8_per_channel(w)
    assert ((f8.float() * sf[:, None] - w).abs() <= w.abs() * 2**-4 + sf[:, None] * 2**-9).all()


def test_quantized_matmul_refs_match_float64():
    x = torch.randn(3, 32, dtype=f64)
    w = torch.randn(5, 32)
    q8, s8 = quant.quantize_int8_per_channel(w)
    want = torch.tensor(
        [[sum(x[m, c] * q8[n, c].item() * s8[n].item() for c in range(32)) for n in range(5)] for m in range(3)],
        dtype=f64,
    )
    torch.testing.assert_close(ref.int8_weight_matmul_ref(x, q8, s8), want)
    f8, sf = quant.quantize_fp8_per_channel(w)
    torch.testing.assert_close(ref.fp8_weight_matmul_ref(x, f8, sf), x @ (f8.double() * sf.double()[:, None]).T)
    xq, xs = quant.round_half_away(x * 10).to(torch.int8), torch.rand(3, dtype=f64)
    got = ref.w8a8_matmul_ref(xq, xs, q8, s8, torch.float64)
    torch.testing.assert_close(got, (xq.double() * xs[:, None]) @ (q8.double() * s8.double()[:, None]).T)


def test_smoothquant_scales_balance_ranges():
    act_max = torch.tensor([100.0, 1.0, 4.0])
    w = torch.tensor([[0.5, 2.0, 1.0], [0.1, -1.0, 0.25]])
    s = quant.smoothquant_scales(act_max, w, alpha=0.5)
    # after migration x / s and w * s have equal per-channel ranges at alpha = 0.5
    torch.testing.assert_close(act_max / s, (w * s).abs().amax(0))
    assert F.linear(torch.ones(1, 3) / s, w * s).allclose(F.linear(torch.ones(1, 3), w))
