"""The online-softmax step shared by FlashAttention prefill and paged decode.

A query block keeps a running row max `m`, a running denominator `l` and an unnormalised
accumulator `acc`. Each key tile updates them without ever holding the full score row:

    m' = max(m, rowmax(s));  alpha = 2^(m - m');  p = 2^(s - m')
    l' = l * alpha + rowsum(p);  acc' = acc * alpha + p @ V

and the output is acc / l at the end. Scores are in log2 units (pre-multiplied by log2(e)).

Soft-capping (Gemma 2/3, SOFTCAP): the scaled score x becomes softcap * tanh(x / softcap) before the
mask; the launchers then pass qk_scale = scale / softcap and cap = softcap * log2(e), so a score is
tanh(q.k * qk_scale) * cap (still in log2 units). Attention sinks (gpt-oss) need no change here: a
sink joins the denominator once, at the end (out * sigmoid(lse - sink), the launchers' epilogues).
"""

import triton
import triton.language as tl

from ._utils import LOG2E


@triton.jit
def tanh(x):
    """tanh from exp2 (libdevice's tanh does not run in the interpreter): e = exp(-2|x|) lies in
    (0, 1], so (1 - e) / (1 + e) never overflows; the sign is put back afterwards."""
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # -2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def scores(q, k, qk_scale, cap, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Scores q k^T of a tile in log2 units, soft-capped when SOFTCAP (see the module's docstring)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if SOFTCAP:
        s = tanh(s * qk_scale) * cap
    else:
        s = s * qk_scale
    return s


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    q_pos,
    k_pos,
    k_valid,
    qk_scale,
    window,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    PRECISION: tl.constexpr,
    cap,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax update of (acc, m_i, l_i) with a [BLOCK_N] tile of keys k and values v.

    q_pos/k_pos are absolute positions; a key is visible iff k_valid and (causal) k_pos <= q_pos and
    (windowed) q_pos - k_pos < window; cap/SOFTCAP: soft-capping, see the module's docstring.
    """
    s = scores(q, k, qk_scale, cap, SOFTCAP, PRECISION)
    keep = k_valid[None, :]
    if CAUSAL:
        keep = keep & (k_pos[None, :] <= q_pos[:, None])
    if WINDOWED:
        keep = keep & (q_pos[:, None] - k_pos[None, :] < window)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


def score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap) the kernels take for softmax scale `scale` and soft-cap `softcap` (0: off)."""
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0
