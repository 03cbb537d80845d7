"""The online-softmax step shared by FlashAttention prefill and paged decode.

A query block keeps a running row max `m`, a running denominator `l` and an unnormalised
accumulator `acc`. Each key tile updates them without ever holding the full score row:

    m' = max(m, rowmax(s));  alpha = 2^(m - m');  p = 2^(s - m')
    l' = l * alpha + rowsum(p);  acc' = acc * alpha + p @ V

and the output is acc / l at the end. Scores are in log2 units (pre-multiplied by log2(e)).
"""

import triton
import triton.language as tl


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
):
    """One online-softmax update of (acc, m_i, l_i) with a [BLOCK_N] tile of keys k and values v.

    q_pos/k_pos are absolute positions; a key is visible iff k_valid and (causal) k_pos <= q_pos and
    (windowed) q_pos - k_pos < window.
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
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
