"""Mamba2's chunked selective scan (SSD, "state space duality"): a Triton kernel and a torch path.

Per head the recurrence is h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t (state h is
[head_dim, d_state]); kernels/reference.py runs it token by token as the specification. Both paths
here cut the sequence into chunks: inside a chunk the outputs are a masked "attention" C B^T
weighted by the decay between positions (matmuls), and only the state crosses chunk boundaries.
The state comes in (`initial_state`) and goes out (the final state), so serving can carry it across
prefill chunks and decode steps. The result does not depend on the chunk size (up to rounding), so
the kernel picks its own chunk length for the hardware instead of the model's mamba_chunk_size.

Triton: one program per (batch, head, block of head_dim) walks the chunks in order, holding the
state in registers: per chunk three dots (C B^T, that times x, C times the state) and one for the
state update. Forward only; with autograd recording the torch path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import alloc, dot_precision, needs_grad, next_pow2, use_triton


@triton.jit
def _ssd_scan_kernel(
    X,
    DT,
    A,
    B,
    C,
    Y,
    S0,
    S,
    seqlen,
    stride_xb,
    stride_xl,
    stride_xh,
    stride_db,
    stride_dl,
    stride_dh,
    stride_bb,
    stride_bl,
    stride_bg,
    stride_cb,
    stride_cl,
    stride_cg,
    stride_yb,
    stride_yl,
    stride_yh,
    NUM_HEADS: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    HAS_INIT: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    bi, hi = pid // NUM_HEADS, pid % NUM_HEADS
    gi = hi // HEADS_PER_GROUP
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    p_ok, n_ok = offs_p < P, offs_n < N
    state_off = ((bi * NUM_HEADS + hi) * P + offs_p[:, None]) * N + offs_n[None, :]
    state_mask = p_ok[:, None] & n_ok[None, :]
    if HAS_INIT:
        state = tl.load(S0 + state_off, mask=state_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    a = tl.load(A + hi).to(tl.float32)
    causal = offs_l[:, None] >= offs_l[None, :]
    for start in range(0, seqlen, BLOCK_L):
        rows = start + offs_l
        l_ok = rows < seqlen
        # Padded rows have dt = 0: no decay and no input, so the chunk's last cumsum is exact.
        dt = tl.load(DT + bi * stride_db + rows * stride_dl + hi * stride_dh, mask=l_ok, other=0.0).to(tl.float32)
        step = dt * a
        cs = tl.cumsum(step, 0)  # log decay from the chunk start to each row (inclusive)
        # seg[l, s] = log decay over steps s+1..l, summed directly: cs_l - cs_s would lose the low
        # bits once the cumsum is large (a fast-decaying stretch before a slow one).
        seg = tl.cumsum(tl.where(offs_l[:, None] > offs_l[None, :], step[:, None], 0.0), 0)
        x = tl.load(
            X + bi * stride_xb + rows[:, None] * stride_xl + hi * stride_xh + offs_p[None, :],
            mask=l_ok[:, None] & p_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        ln_mask = l_ok[:, None] & n_ok[None, :]
        b = tl.load(
            B + bi * stride_bb + rows[:, None] * stride_bl + gi * stride_bg + offs_n[None, :], mask=ln_mask, other=0.0
        )
        c = tl.load(
            C + bi * stride_cb + rows[:, None] * stride_cl + gi * stride_cg + offs_n[None, :], mask=ln_mask, other=0.0
        )
        b, c = b.to(tl.float32), c.to(tl.float32)
        # Within the chunk: y_l = sum_{s<=l} (C_l . B_s) exp(cs_l - cs_s) dt_s x_s.
        scores = tl.dot(c, tl.trans(b), input_precision=PRECISION)
        decay = tl.exp(tl.where(causal, seg, 0.0))
        scores = tl.where(causal, scores * decay, 0.0) * dt[None, :]
        y = tl.dot(scores, x, input_precision=PRECISION)
        # From the state at the chunk start, decayed to each row.
        y += tl.dot(c, tl.trans(state), input_precision=PRECISION) * tl.exp(cs)[:, None]
        tl.store(
            Y + bi * stride_yb + rows[:, None] * stride_yl + hi * stride_yh + offs_p[None, :],
            y,
            mask=l_ok[:, None] & p_ok[None, :],
        )
        last = tl.sum(tl.where(offs_l == BLOCK_L - 1, cs, 0.0), 0)
        to_end = tl.sum(tl.where(offs_l[:, None] == BLOCK_L - 1, seg, 0.0), 0)  # seg's last row
        w = dt * tl.exp(to_end)
        state = state * tl.exp(last) + tl.dot(tl.trans(x), b * w[:, None], input_precision=PRECISION)
    tl.store(S + state_off, state, mask=state_mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def ssd_scan_triton(x, dt, A, B, C, initial_state=None):
    """The Triton path of ssd_scan (its own chunk length; see the module docstring)."""
    x, dt, B, C = (_last_dim_contiguous(t) for t in (x, dt, B, C))
    b, length, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    y = alloc((b, length, heads, p), torch.float32, x.device)
    final = alloc((b, heads, p, n), torch.float32, x.device)
    init = initial_state.float().contiguous() if initial_state is not None else final
    block_n = max(16, next_pow2(n))
    block_p = min(32 if block_n > 128 else 64, max(16, next_pow2(p)))
    _ssd_scan_kernel[(b * heads, triton.cdiv(p, block_p))](
        x,
        dt,
        A.float().contiguous(),
        B,
        C,
        y,
        init,
        final,
        length,
        *x.stride()[:3],
        *dt.stride(),
        *B.stride()[:3],
        *C.stride()[:3],
        *y.stride()[:3],
        NUM_HEADS=heads,
        HEADS_PER_GROUP=heads // groups,
        P=p,
        N=n,
        HAS_INIT=initial_state is not None,
        BLOCK_L=64 if block_n <= 128 else 32,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        PRECISION=dot_precision(x.dtype),
        num_warps=4,
    )
    return y, final


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[b, nc, L, h] -> [b, nc, l, s, h]: the sum of a over steps s+1..l, -inf where s > l. Summed
    directly rather than as cs_l - cs_s, which loses the low bits once the cumsum is large."""
    L = a.shape[2]
    strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)[..., None]
    summed = a[:, :, :, None].expand(-1, -1, -1, L, -1).masked_fill(~strict, 0.0).cumsum(dim=2)
    return summed.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=a.device).tril()[..., None], float("-inf"))


def ssd_scan_torch(x, dt, A, B, C, chunk_size, initial_state=None):
    """The plain-PyTorch chunked scan (differentiable; the model's path off CUDA and in training)."""
    b, length, heads, p = x.shape
    L = max(1, min(chunk_size, length))  # a decode step is one chunk of one token, not a padded chunk
    pad = (-length) % L
    rep = heads // B.shape[2]

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [b, l, ...] -> [b, nc, L, ...], zero-padded, fp32
        t = F.pad(t.float(), (0, 0) * (t.dim() - 2) + (0, pad))
        return t.view(b, -1, L, *t.shape[2:])

    x, dt = chunks(x), chunks(dt)
    B, C = (chunks(t.repeat_interleave(rep, dim=2)) for t in (B, C))
    a = dt * A.float()  # [b, nc, L, h]: log decay of each step
    cs = torch.cumsum(a, dim=2)  # log decay from the chunk start
    seg = _segment_sum(a)
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * torch.exp(seg)
    y = torch.einsum("bclsh,bcshp->bclhp", scores, x * dt[..., None])
    # Each chunk's contribution to the state at its end, then the states chained across chunks.
    to_end = torch.exp(seg[:, :, -1]) * dt  # decay from each step to the chunk's end
    contrib = torch.einsum("bclhn,bclhp->bchpn", B * to_end[..., None], x)
    state = x.new_zeros(b, heads, p, B.shape[-1]) if initial_state is None else initial_state.float()
    starts = []
    for c in range(x.shape[1]):
        starts.append(state)
        state = state * torch.exp(cs[:, c, -1])[..., None, None] + contrib[:, c]
    y = y + torch.einsum("bclhn,bchpn->bclhp", C, torch.stack(starts, dim=1)) * torch.exp(cs)[..., None]
    return y.reshape(b, -1, heads, p)[:, :length], state


def ssd_scan(x, dt, A, B, C, chunk_size: int, initial_state: torch.Tensor | None = None):
    """Chunked selective scan. x [b, l, h, p], dt [b, l, h] (the discretisation step, after
    softplus), A [h] (negative), B and C [b, l, g, n], initial_state [b, h, p, n] or None.
    Returns (y [b, l, h, p], final_state [b, h, p, n]), both float32."""
    tensors = (x, dt, A, B, C) + ((initial_state,) if initial_state is not None else ())
    if use_triton(*tensors) and not needs_grad(*tensors):
        return ssd_scan_triton(x, dt, A, B, C, initial_state)
    return ssd_scan_torch(x, dt, A, B, C, chunk_size, initial_state)
