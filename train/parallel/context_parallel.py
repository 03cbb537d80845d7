"""Context parallelism: ring attention over a sequence split across the cp ranks.

Each rank keeps its queries; key/value blocks travel around the ring with p2p sends (the next
block is in flight while the current one is computed), and each block's partial attention is
merged with online-softmax statistics (running log-sum-exp), as in Ring Attention (Liu et al.
2023) and flash attention. The backward pass sends the key/value blocks around again, together
with their gradient accumulators, which arrive back at their owner after a full turn.

Causal load balancing (zigzag): the sequence is cut into 2*cp chunks and rank r holds chunks r and
2*cp-1-r. Then, at every ring step but the first, exactly half of each block is needed: from an
earlier rank, all queries attend to the first half of its keys; from a later rank, only the second
half of the queries attend to all of its keys. Every rank does the same work at every step, where
a contiguous split would leave the last rank with cp times the work of the first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by `rank`: chunks rank and 2*cp-1-rank of 2*cp."""
    c = seq_len // (2 * cp)
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    )


def zigzag_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    return x.index_select(dim, zigzag_indices(x.shape[dim], cp, rank).to(x.device))


def _ring_exchange(send: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list[Any]]:
    """Start sending `send` to the next rank and receiving the previous rank's into a new buffer."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _blocks(step: int, rank: int, size: int, n: int) -> tuple[slice, slice, bool] | None:
    """(query rows, key columns, causal) that ring step `step` computes under the zigzag split
    (n local tokens); the key/value block then comes from rank (rank - step) % size."""
    src, half = (rank - step) % size, n // 2
    if step == 0:
        return slice(0, n), slice(0, n), True  # own tokens: positions increase along the local order
    if src < rank:
        return slice(0, n), slice(0, half), False
    return slice(half, n), slice(0, n), False


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] (local zigzag tokens) -> out [B, Hq, S, D]."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, group: dist.ProcessGroup):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        rep, n = q.shape[1] // k.shape[1], q.shape[2]
        acc = torch.promote_types(q.dtype, torch.float32)  # accumulate in at least fp32
        qf = q.to(acc)
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(size):
            if step < size - 1:
                nxt, reqs = _ring_exchange(kv, group)
            rows, cols, causal = _blocks(step, rank, size, n)
            kb, vb = (t[:, :, cols].to(acc).repeat_interleave(rep, dim=1) for t in kv)
            s = _scores(qf[:, :, rows], kb, scale, causal)
            lse_b = torch.logsumexp(s, dim=-1)
            out_b = torch.exp(s - lse_b[..., None]) @ vb
            new = torch.logaddexp(lse[:, :, rows], lse_b)
            out[:, :, rows] = (
                out[:, :, rows] * torch.exp(lse[:, :, rows] - new)[..., None]
                + out_b * torch.exp(lse_b - new)[..., None]
            )
            lse[:, :, rows] = new
            if step < size - 1:
                for r in reqs:
                    r.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        b, hkv, n, d = k.shape
        rep = q.shape[1] // hkv
        acc = out.dtype
        qf, do = q.to(acc), grad_out.to(acc)
        delta = (do * out).sum(-1)  # rowsum(dO * O)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        for step in range(size):
            if step < size - 1:
                nxt, reqs = _ring_exchange(kv, group)
            rows, cols, causal = _blocks(step, rank, size, n)
            kb, vb = (t[:, :, cols].to(acc).repeat_interleave(rep, dim=1) for t in kv)
            p = torch.exp(_scores(qf[:, :, rows], kb, scale, causal) - lse[:, :, rows, None])
            dv_b = p.transpose(-1, -2) @ do[:, :, rows]
            ds = p * (do[:, :, rows] @ vb.transpose(-1, -2) - delta[:, :, rows, None])
            dq[:, :, rows] += (ds @ kb) * scale
            dk_b = (ds.transpose(-1, -2) @ qf[:, :, rows]) * scale
            m = cols.stop - cols.start
            dkv[0, :, :, cols] += dk_b.view(b, hkv, rep, m, d).sum(2)
            dkv[1, :, :, cols] += dv_b.view(b, hkv, rep, m, d).sum(2)
            # The accumulators follow their key/value block around the ring; after `size` hops
            # each is back at its owner with every rank's contribution.
            dkv, dreqs = _ring_exchange(dkv, group)
            for r in dreqs:
                r.wait()
            if step < size - 1:
                for r in reqs:
                    r.wait()
                kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


class RingAttention:
    """An attention backend (see baton.common.model.AttentionBackend) for zigzag-sharded
    sequences; causal, full attention (no sliding window, sinks or soft-capping)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any) -> torch.Tensor:
        if getattr(layer, "sinks", None) is not None or getattr(layer, "logit_softcap", None):
            # (the recipe checks refuse these models with parallel.cp > 1 before any work)
            raise NotImplementedError("ring attention has no attention sinks or soft-capped scores")
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return _RingAttention.apply(q, k, v, layer.scaling, self.group).transpose(1, 2)
