"""The gated delta rule (Gated DeltaNet: the linear-attention layers of Qwen3.5 and Qwen3-Next).

Per value head the state S is [Dk, Dv]. Token t decays it, writes the correction of what it
predicts for k_t (the delta rule) with strength beta_t, and is read by q_t:
    S' = exp(g_t) S_{t-1};   S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T;   o_t = S_t^T (scale q_t)
(transformers' torch_recurrent_gated_delta_rule; g_t <= 0 is the log decay). q and k have Hk heads,
v, g and beta Hv, a multiple: value head h reads key head h // (Hv // Hk), as transformers'
repeat_interleave. The state is float32; q/k are L2-normalised here when use_qk_l2norm_in_kernel
(eps 1e-6 inside the rsqrt, as transformers and fla), and the scale defaults to Dk**-0.5.

Chunked (WY) form. In a chunk of L tokens starting from state S0, write u_j for token j's correction
beta_j (v_j - (state before j, decayed)^T k_j). Expanding that state gives a triangular system
    (I + A) u = beta V - (beta Gamma K) S0,   A_ij = beta_i (k_i . k_j) exp(g_{j+1} + ... + g_i), i > j,
with Gamma_i = exp(g_1 + ... + g_i), so u = U - W S0 where W = (I + A)^-1 beta Gamma K and
U = (I + A)^-1 beta V do not depend on the state. Then
    O = (Gamma Q) S0 + (Q K^T * D) u,   S_L = Gamma_L S0 + (K * exp(g_{j+1} + ... + g_L))^T u
with D the causal decays exp(g_{j+1} + ... + g_i), i >= j. Everything but the last line and u is
parallel over chunks; only the state crosses chunk boundaries. The decays between positions are
summed directly rather than as differences of the chunk's cumsum, which lose their low bits when a
fast-decaying stretch precedes a slow one (kernels/ssd_scan.py's lesson). The result does not depend
on the chunk length (up to rounding), so each path may pick its own.

Paths: gated_delta_rule_ref (token by token, float64 by default: the specification),
gated_delta_rule_torch (chunked, differentiable: training and CPU prefill), gated_delta_rule_recurrent
(token by token in float32, in place), gated_delta_rule_triton (two kernels: per chunk W and U, in
parallel; then one program per (sequence, head, block of Dv) walks the chunks holding the state in
registers), and decode_step (one token per sequence, states gathered from and written back to a slot
pool: how the server holds them) with a Triton kernel that updates the pool in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import alloc, cdiv, dot_precision, needs_grad, next_pow2, use_triton

__all__ = [
    "CPU_RECURRENT_MAX_LEN",
    "decode_step",
    "gated_delta_decode_torch",
    "gated_delta_decode_triton",
    "gated_delta_rule",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_ref",
    "gated_delta_rule_torch",
    "gated_delta_rule_triton",
    "l2norm",
]

# On CPU the token loop beats the chunked form only for the shortest inputs (benchmarks/gated_delta_cpu.py:
# its fixed per-chunk cost - a triangular solve, masks - outweighs a few steps' state passes).
CPU_RECURRENT_MAX_LEN = 4


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim: the eps placement transformers and fla use."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def check_inputs(q, k, v, g, beta, state=None, *, token_dim: bool = True) -> tuple[int, int, int, int]:
    """(Hk, Hv, Dk, Dv) of a call, or a ValueError naming the argument that does not fit."""
    lead = 2 if token_dim else 1  # [B, T, H, D] or one token per row [N, H, D]
    if q.dim() != lead + 2 or k.shape != q.shape:
        raise ValueError(
            f"q and k must both be [{'B, T' if token_dim else 'N'}, Hk, Dk]: {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if v.dim() != lead + 2 or v.shape[:lead] != q.shape[:lead]:
        raise ValueError(
            f"v must be [{'B, T' if token_dim else 'N'}, Hv, Dv] like q: {tuple(v.shape)} vs q {tuple(q.shape)}"
        )
    hk, dk = q.shape[-2:]
    hv, dv = v.shape[-2:]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of query/key heads ({hk})")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != v.shape[:-1]:
            raise ValueError(f"{name} must be {tuple(v.shape[:-1])} (one per token and value head): {tuple(t.shape)}")
    if state is not None and tuple(state.shape[-3:]) != (hv, dk, dv):
        raise ValueError(f"state must be [..., {hv}, {dk}, {dv}] (Hv, Dk, Dv): {tuple(state.shape)}")
    return hk, hv, dk, dv


def _scale(dk: int, scale: float | None) -> float:
    return dk**-0.5 if scale is None else scale


def _prepare_qk(q, k, scale, l2):
    """float32 q and k, L2-normalised if asked, q scaled."""
    q, k = q.float(), k.float()
    if l2:
        q, k = l2norm(q), l2norm(k)
    return q * _scale(q.shape[-1], scale), k


def gated_delta_rule_ref(
    q, k, v, g, beta, initial_state=None, *, scale=None, use_qk_l2norm_in_kernel=False, dtype=torch.float64
):
    """The specification, token by token in `dtype` (differentiable). Returns (o [B, T, Hv, Dv],
    final state [B, Hv, Dk, Dv]), both in `dtype`."""
    hk, hv, dk, dv = check_inputs(q, k, v, g, beta, initial_state)
    q, k = (t.to(dtype).repeat_interleave(hv // hk, dim=2) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * _scale(dk, scale)
    v, g, beta = (t.to(dtype) for t in (v, g, beta))
    b = q.shape[0]
    state = q.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.to(dtype)
    outs = []
    for t in range(q.shape[1]):
        state = state * torch.exp(g[:, t])[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - predicted))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    o = torch.stack(outs, dim=1) if outs else q.new_zeros(b, 0, hv, dv)
    return o, state


def _segment_sums(g: torch.Tensor) -> torch.Tensor:
    """g [..., L] -> [..., L, L]: entry (i, j) = g_{j+1} + ... + g_i for i > j, 0 elsewhere."""
    L = g.shape[-1]
    strict = torch.ones(L, L, dtype=torch.bool, device=g.device).tril(-1)
    return g[..., :, None].expand(*g.shape, L).masked_fill(~strict, 0.0).cumsum(dim=-2)


def gated_delta_rule_torch(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    output_final_state=True,
    chunk_size=64,
    *,
    scale=None,
    use_qk_l2norm_in_kernel=False,
):
    """The chunked (WY) form in plain torch, float32 (differentiable). Returns (o [B, T, Hv, Dv] in
    q's dtype, final state [B, Hv, Dk, Dv] float32, or None)."""
    hk, hv, dk, dv = check_inputs(q, k, v, g, beta, initial_state)
    b, length, rep, out_dtype = q.shape[0], q.shape[1], hv // hk, q.dtype
    L = max(1, min(chunk_size, length))  # a short input is one chunk of its length, not a padded one
    pad = (-length) % L
    nc = (length + pad) // L

    def chunks(t: torch.Tensor, heads: int) -> torch.Tensor:
        """[b, T, H(, D)] -> [nc, b, Hk, H // Hk, L(, D)], contiguous float32 (each chunk's slice is one
        block for the matmuls), zero-padded: g = beta = 0 there, so padded steps neither decay nor write."""
        t = F.pad(t.float(), (0, 0) * (t.dim() - 2) + (0, pad))
        t = t.view(b, nc, L, hk, heads // hk, *t.shape[3:])
        return t.permute(1, 0, 3, 4, 2, *range(5, t.dim())).contiguous()

    q, k = _prepare_qk(q, k, scale, use_qk_l2norm_in_kernel)
    q, k = chunks(q, hk), chunks(k, hk)  # [nc, b, Hk, 1, L, Dk]: one per group of value heads
    v, g, beta = chunks(v, hv), chunks(g, hv), chunks(beta, hv)  # [nc, b, Hk, rep, L(, Dv)]
    seg = _segment_sums(g)
    decay = torch.exp(seg).tril()  # D: causal decays, 1 on the diagonal
    gamma = torch.exp(g.cumsum(dim=-1))  # from the chunk's start, this token's decay included
    a = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    # (I + A)^-1 (the solver reads only A's strict lower triangle, 1 on the diagonal): an L-column
    # solve and two matmuls cost less than solving for W and U's Dk + Dv columns directly
    eye = torch.eye(L, dtype=a.dtype, device=a.device)
    inv = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
    w, u = inv @ (k * (beta * gamma)[..., None]), inv @ (v * beta[..., None])
    p = (q @ k.transpose(-1, -2)) * decay
    # o = (Gamma Q) S0 + P (U - W S0): all but the S0 products are computed for every chunk at once
    q_eff, o_intra = q * gamma[..., None] - p @ w, p @ u
    k_end_t = (k * torch.exp(seg[..., -1, :])[..., None]).transpose(-1, -2)  # decayed to the chunk's end
    chunk_decay = gamma[..., -1, None, None]
    if initial_state is None:
        state = q.new_zeros(b, hk, rep, dk, dv)
    else:
        state = initial_state.float().reshape(b, hk, rep, dk, dv)
    starts = []
    for c in range(nc):
        starts.append(state)
        state = state * chunk_decay[c] + k_end_t[c] @ (u[c] - w[c] @ state)
    o = (q_eff @ torch.stack(starts) + o_intra) if nc else o_intra  # [nc, b, Hk, rep, L, Dv]
    o = o.permute(1, 0, 4, 2, 3, 5).reshape(b, nc * L, hv, dv)[:, :length].to(out_dtype)
    return o, (state.reshape(b, hv, dk, dv) if output_final_state else None)


def _step(q, k, v, g, beta, state):
    """One token per row; state [N, Hk, rep, Dk, Dv] float32 contiguous, updated in place. q (scaled),
    k [N, Hk, 1, Dk]; v [N, Hk, rep, Dv]; g, beta [N, Hk, rep]. Returns o [N, Hk, rep, Dv].

    Both reads come from the old state in one matmul (S'^T k = e^g S^T k, and the new state read by q
    is e^g S^T q + (q . k) delta): three passes over the state (read, scale, rank-1 add), not five."""
    decay = torch.exp(g)[..., None]  # [N, Hk, rep, 1]
    read = (torch.stack([k, q], dim=-2) @ state) * decay[..., None]  # [N, Hk, rep, 2, Dv]
    delta = beta[..., None] * (v - read[..., 0, :])
    o = read[..., 1, :] + (q * k).sum(-1, keepdim=True) * delta
    dk, dv = state.shape[-2:]
    flat = state.view(-1, dk, dv).mul_(decay.reshape(-1, 1, 1))
    flat.baddbmm_(k.expand(*state.shape[:-1]).reshape(-1, dk, 1), delta.reshape(-1, 1, dv))
    return o


def gated_delta_rule_recurrent(
    q, k, v, g, beta, initial_state=None, output_final_state=True, *, scale=None, use_qk_l2norm_in_kernel=False
):
    """Token by token in float32, the state updated in place (no autograd): the decode path for a
    batch of states, and short inputs on CPU. Same arguments and results as gated_delta_rule_torch."""
    hk, hv, dk, dv = check_inputs(q, k, v, g, beta, initial_state)
    b, length, rep, out_dtype = q.shape[0], q.shape[1], hv // hk, q.dtype
    q, k = (t.reshape(b, length, hk, 1, dk) for t in _prepare_qk(q, k, scale, use_qk_l2norm_in_kernel))
    v = v.float().reshape(b, length, hk, rep, dv)  # reshape: inputs may be strided views
    g, beta = (t.float().reshape(b, length, hk, rep) for t in (g, beta))
    if initial_state is None:
        state = q.new_zeros(b, hk, rep, dk, dv)
    else:  # a copy: the caller's tensor is not updated
        state = initial_state.to(torch.float32, copy=True).reshape(b, hk, rep, dk, dv)
    o = q.new_empty(b, length, hk, rep, dv)
    for t in range(length):
        o[:, t] = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
    return o.view(b, length, hv, dv).to(out_dtype), (state.view(b, hv, dk, dv) if output_final_state else None)


def _check_pool(state_pool, slots, n: int) -> None:
    if slots.dim() != 1 or slots.shape[0] != n or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slots must be {n} int32/int64 pool indices (one per row): {tuple(slots.shape)} {slots.dtype}"
        )
    if state_pool.dim() != 4 or not state_pool.is_contiguous():
        raise ValueError(f"state_pool must be a contiguous [slots, Hv, Dk, Dv] tensor: {tuple(state_pool.shape)}")


def gated_delta_decode_torch(q, k, v, g, beta, state_pool, slots, *, scale=None, use_qk_l2norm_in_kernel=False):
    """decode_step's torch path: the rows' states gathered from the pool, stepped, written back."""
    hk, hv, dk, dv = check_inputs(q, k, v, g, beta, state_pool, token_dim=False)
    _check_pool(state_pool, slots, q.shape[0])
    n, rep, out_dtype = q.shape[0], hv // hk, q.dtype
    q, k = (t.reshape(n, hk, 1, dk) for t in _prepare_qk(q, k, scale, use_qk_l2norm_in_kernel))
    state = state_pool.index_select(0, slots.long()).float().view(n, hk, rep, dk, dv)  # a fresh copy
    g, beta = (t.float().reshape(n, hk, rep) for t in (g, beta))
    o = _step(q, k, v.float().reshape(n, hk, rep, dv), g, beta, state)
    state_pool.index_copy_(0, slots.long(), state.view(n, hv, dk, dv).to(state_pool.dtype))
    return o.view(n, hv, dv).to(out_dtype)


@triton.jit
def _load_rows(ptr, rows, row_ok, stride_t, offs, col_ok):
    return tl.load(ptr + rows[:, None] * stride_t + offs[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _unit_lower_inverse(a, offs, BT: tl.constexpr):
    """(I + a)^-1 for a strictly lower [BT, BT] tile, by forward substitution in 16-row blocks (fla's
    order): row r of X is e_r - sum_{j<r} a_rj X_j. First the four diagonal blocks together, one row
    of each per step (m = X - I there; row r still holds -a_r when its turn comes); then each block row
    from those above it, X_i = Xd_i (E_i - sum_{m<i} a_im X_m). Dots in full fp32 throughout: no
    powers of a (a Neumann product cancels catastrophically when keys repeat)."""
    blk = offs // 16
    m = tl.where(blk[:, None] == blk[None, :], -a, 0.0)
    for r in range(1, 16):
        sel = (offs % 16 == r)[:, None]
        rows = tl.where(sel, m, 0.0)
        m = tl.where(sel, rows + tl.dot(rows, m, input_precision="ieee"), m)
    xd = m + tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)
    below = tl.where(blk[:, None] > blk[None, :], a, 0.0)  # a's blocks left of the diagonal
    x = xd
    for i in tl.static_range(1, BT // 16):
        sel = (blk == i)[:, None]
        r = tl.dot(tl.where(sel, below, 0.0), x, input_precision="ieee")  # reads block rows < i, done
        x -= tl.dot(tl.where(sel, xd, 0.0), r, input_precision="ieee")
    return x


@triton.jit
def _wy_kernel(
    K, V, G, BETA, W, U, seqlen,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_gb, stride_gt, stride_gh, stride_bb, stride_bt, stride_bh,
    HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, TPAD: tl.constexpr,
    L2NORM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BV_ALL: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One chunk of one (sequence, value head): W = (I + A)^-1 beta Gamma K and U = (I + A)^-1 beta V."""
    c, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    bi, h = pid // HV, pid % HV
    offs_t, offs_k = tl.arange(0, BT), tl.arange(0, BK)
    rows = c * BT + offs_t
    t_ok, k_ok = rows < seqlen, offs_k < DK
    g = tl.load(G + bi * stride_gb + rows * stride_gt + h * stride_gh, mask=t_ok, other=0.0).to(tl.float32)
    beta = tl.load(BETA + bi * stride_bb + rows * stride_bt + h * stride_bh, mask=t_ok, other=0.0).to(tl.float32)
    k = _load_rows(K + bi * stride_kb + (h // REP) * stride_kh, rows, t_ok, stride_kt, offs_k, k_ok).to(tl.float32)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    strict = offs_t[:, None] > offs_t[None, :]
    seg = tl.cumsum(tl.where(strict, g[:, None], 0.0), 0)  # g_{j+1} + ... + g_i, summed directly
    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    a = tl.where(strict, beta[:, None] * kk * tl.exp(tl.where(strict, seg, 0.0)), 0.0)
    x = _unit_lower_inverse(a, offs_t, BT)
    out_rows = pid * TPAD + rows
    w = tl.dot(x, k * (beta * tl.exp(tl.cumsum(g, 0)))[:, None], input_precision=PRECISION)
    tl.store(W + out_rows[:, None] * DK + offs_k[None, :], w, mask=k_ok[None, :])
    for v0 in tl.static_range(0, BV_ALL, BV):
        offs_v = v0 + tl.arange(0, BV)
        v = _load_rows(V + bi * stride_vb + h * stride_vh, rows, t_ok, stride_vt, offs_v, offs_v < DV)
        u = tl.dot(x, v.to(tl.float32) * beta[:, None], input_precision=PRECISION)
        tl.store(U + out_rows[:, None] * DV + offs_v[None, :], u, mask=offs_v[None, :] < DV)


@triton.jit
def _chunk_kernel(
    Q, K, W, U, G, OUT, S0, S, seqlen, scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_gb, stride_gt, stride_gh, stride_ob, stride_ot, stride_oh,
    HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, TPAD: tl.constexpr,
    L2NORM: tl.constexpr, HAS_INIT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One (sequence, value head, block of Dv) walks the chunks in order, the state in registers."""
    pid = tl.program_id(0).to(tl.int64)
    bi, h = pid // HV, pid % HV
    offs_t, offs_k = tl.arange(0, BT), tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    k_ok, v_ok = offs_k < DK, offs_v < DV
    state_ptrs = (pid * DK + offs_k[:, None]) * DV + offs_v[None, :]
    state_mask = k_ok[:, None] & v_ok[None, :]
    if HAS_INIT:
        state = tl.load(S0 + state_ptrs, mask=state_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    causal = offs_t[:, None] >= offs_t[None, :]
    q_base = Q + bi * stride_qb + (h // REP) * stride_qh
    k_base = K + bi * stride_kb + (h // REP) * stride_kh
    for start in range(0, seqlen, BT):
        rows = start + offs_t
        t_ok = rows < seqlen
        # u = U - W S0: this chunk's corrections, now that its starting state is known
        w = _load_rows(W + pid * TPAD * DK, rows, t_ok, DK, offs_k, k_ok)
        u = _load_rows(U + pid * TPAD * DV, rows, t_ok, DV, offs_v, v_ok)
        u -= tl.dot(w, state, input_precision=PRECISION)
        g = tl.load(G + bi * stride_gb + rows * stride_gt + h * stride_gh, mask=t_ok, other=0.0).to(tl.float32)
        gamma = tl.cumsum(g, 0)
        seg = tl.cumsum(tl.where(offs_t[:, None] > offs_t[None, :], g[:, None], 0.0), 0)
        q = _load_rows(q_base, rows, t_ok, stride_qt, offs_k, k_ok).to(tl.float32)
        k = _load_rows(k_base, rows, t_ok, stride_kt, offs_k, k_ok).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None]
            k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        q = q * scale
        p = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p = tl.where(causal, p * tl.exp(tl.where(causal, seg, 0.0)), 0.0)
        o = tl.dot(q * tl.exp(gamma)[:, None], state, input_precision=PRECISION)
        o += tl.dot(p, u, input_precision=PRECISION)
        tl.store(
            OUT + bi * stride_ob + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
            o.to(OUT.dtype.element_ty),
            mask=t_ok[:, None] & v_ok[None, :],
        )
        last = tl.sum(tl.where(offs_t == BT - 1, gamma, 0.0), 0)  # padded rows have g = 0
        to_end = tl.sum(tl.where(offs_t[:, None] == BT - 1, seg, 0.0), 0)
        state = state * tl.exp(last) + tl.dot(tl.trans(k * tl.exp(to_end)[:, None]), u, input_precision=PRECISION)
    tl.store(S + state_ptrs, state, mask=state_mask)


@triton.jit
def _decode_kernel(
    Q, K, V, G, BETA, POOL, SLOTS, OUT, scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_gn, stride_gh, stride_bn, stride_bh, stride_on, stride_oh,
    HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    L2NORM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One token of one (row, value head, block of Dv): its slot's state read, stepped and written back."""
    n, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_k, offs_v = tl.arange(0, BK), tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok, v_ok = offs_k < DK, offs_v < DV
    q = tl.load(Q + n * stride_qn + (h // REP) * stride_qh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(K + n * stride_kn + (h // REP) * stride_kh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    v = tl.load(V + n * stride_vn + h * stride_vh + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(G + n * stride_gn + h * stride_gh).to(tl.float32)
    beta = tl.load(BETA + n * stride_bn + h * stride_bh).to(tl.float32)
    slot = tl.load(SLOTS + n).to(tl.int64)
    ptrs = POOL + ((slot * HV + h) * DK + offs_k[:, None]) * DV + offs_v[None, :]
    mask = k_ok[:, None] & v_ok[None, :]
    state = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * tl.exp(g)
    delta = beta * (v - tl.sum(state * k[:, None], 0))
    state += k[:, None] * delta[None, :]
    tl.store(ptrs, state.to(POOL.dtype.element_ty), mask=mask)
    o = tl.sum(state * (q * scale)[:, None], 0)
    tl.store(OUT + n * stride_on + h * stride_oh + offs_v, o.to(OUT.dtype.element_ty), mask=v_ok)


CHUNK = 64  # the Triton path's own chunk length (rows of the [L, L] tiles)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gated_delta_rule_triton(
    q, k, v, g, beta, initial_state=None, output_final_state=True, *, scale=None, use_qk_l2norm_in_kernel=False
):
    """The Triton path of gated_delta_rule (forward only; its own chunk length)."""
    hk, hv, dk, dv = check_inputs(q, k, v, g, beta, initial_state)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    b, length = q.shape[:2]
    tpad = max(1, cdiv(length, CHUNK)) * CHUNK
    bk, bv_all = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    w = alloc((b * hv, tpad, dk), torch.float32, q.device)  # scratch: rows past the sequence are written too
    u = alloc((b * hv, tpad, dv), torch.float32, q.device)
    o = alloc((b, length, hv, dv), q.dtype, q.device)
    final = alloc((b, hv, dk, dv), torch.float32, q.device)
    init = initial_state.float().contiguous() if initial_state is not None else final
    common = dict(HV=hv, REP=hv // hk, DK=dk, DV=dv, TPAD=tpad, L2NORM=use_qk_l2norm_in_kernel, BT=CHUNK, BK=bk)
    precision = dot_precision(q.dtype)
    _wy_kernel[(tpad // CHUNK, b * hv)](
        k, v, g, beta, w, u, length, *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
        **common, BV=min(bv_all, 64), BV_ALL=bv_all, PRECISION=precision, num_warps=4,
    )  # fmt: skip
    bv = min(bv_all, 64 if bk <= 64 else 32 if bk <= 128 else 16)  # the state block and dot staging fit shared memory
    _chunk_kernel[(b * hv, cdiv(dv, bv))](
        q, k, w, u, g, o, init, final, length, _scale(dk, scale),
        *q.stride()[:3], *k.stride()[:3], *g.stride(), *o.stride()[:3],
        **common, HAS_INIT=initial_state is not None, BV=bv, PRECISION=precision,
        num_warps=4 if bk <= 64 else 8, num_stages=1,  # no multi-buffered loads: Dk 128 would overflow shared memory
    )  # fmt: skip
    return o, (final if output_final_state else None)


def gated_delta_decode_triton(q, k, v, g, beta, state_pool, slots, *, scale=None, use_qk_l2norm_in_kernel=False):
    """decode_step's Triton path: each program updates its slot's state block in place in the pool."""
    hk, hv, dk, dv = check_inputs(q, k, v, g, beta, state_pool, token_dim=False)
    _check_pool(state_pool, slots, q.shape[0])
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    n = q.shape[0]
    o = alloc((n, hv, dv), q.dtype, q.device)
    bv = min(32, next_pow2(dv))
    _decode_kernel[(n, hv, cdiv(dv, bv))](
        q, k, v, g, beta, state_pool, slots, o, _scale(dk, scale),
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *g.stride(), *beta.stride(), *o.stride()[:2],
        HV=hv, REP=hv // hk, DK=dk, DV=dv, L2NORM=use_qk_l2norm_in_kernel, BK=next_pow2(dk), BV=bv, num_warps=4,
    )  # fmt: skip
    return o


def gated_delta_rule(
    q, k, v, g, beta, initial_state=None, output_final_state=True, chunk_size=64, *, scale=None,
    use_qk_l2norm_in_kernel=False,
):  # fmt: skip
    """The gated delta rule over a batch of sequences. q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g (log
    decay, <= 0) and beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] or None (zeros). Returns (o [B, T,
    Hv, Dv] in q's dtype, final state float32 or None). CUDA: the Triton kernels (the torch chunked form
    when autograd records); elsewhere the chunked form, or the token loop for the shortest inputs."""
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    tensors = (q, k, v, g, beta) + ((initial_state,) if initial_state is not None else ())
    if use_triton(*tensors) and not needs_grad(*tensors):
        return gated_delta_rule_triton(q, k, v, g, beta, initial_state, output_final_state, **kw)
    if q.shape[1] <= CPU_RECURRENT_MAX_LEN and not needs_grad(*tensors):
        return gated_delta_rule_recurrent(q, k, v, g, beta, initial_state, output_final_state, **kw)
    return gated_delta_rule_torch(q, k, v, g, beta, initial_state, output_final_state, chunk_size, **kw)


def decode_step(q, k, v, g, beta, state_pool, slots, *, scale=None, use_qk_l2norm_in_kernel=False):
    """One token for each of N sequences whose states live in a pool: q, k [N, Hk, Dk]; v [N, Hv, Dv];
    g, beta [N, Hv]; state_pool [P, Hv, Dk, Dv] (contiguous); slots [N] distinct pool indices. Updates
    state_pool[slots] in place; returns o [N, Hv, Dv] in q's dtype. The cost is flat in context length."""
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if use_triton(q, k, v, g, beta, state_pool, slots):
        return gated_delta_decode_triton(q, k, v, g, beta, state_pool, slots, **kw)
    return gated_delta_decode_torch(q, k, v, g, beta, state_pool, slots, **kw)
