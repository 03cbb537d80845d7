"""Owns the KV pools and runs one scheduled step of the shared model through paged attention."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from dataclasses import dataclass

import torch

from baton.common.model import CausalLM, fuse_residual_norms
from baton.kernels.cpu_extension import cpu_kernels
from baton.kernels.reference import rotate_half
from baton.serve.attention import AttentionMetadata, PagedAttention, TreeGroup
from baton.serve.block_manager import BlockOps
from baton.serve.quantization.kv_cache import pool_layout
from baton.serve.sequence import Sequence
from baton.serve.speculative.tree import ancestor_mask, tree_depths


log = logging.getLogger(__name__)

DECODE_ROWS = 8  # chunks up to this long run as decode rows (each re-reads the prefix: short only)


@functools.cache
def keep_freed_memory() -> bool:
    """CPU serving allocates tens of MB per step (gathered K/V, activations) and frees it again.
    glibc serves such blocks with mmap and returns them to the OS on free, so every step would
    page-fault them back in (zeroed by the kernel) - a third of a decode step on this CPU. Raise
    the mmap and trim thresholds once so freed memory stays in the heap for the next step (what
    vLLM's CPU backend gets by preloading tcmalloc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))
    log.debug("keeping freed memory in the heap for CPU serving: %s", ok)
    return ok


def kv_block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    cfg = model.config
    pool_dtype, width = pool_layout(kv_cache_dtype, dtype, cfg.head_dim)
    elem = torch.tensor([], dtype=pool_dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * width * elem


@dataclass
class ExecuteResult:
    """One step's output for the rows that are sampled (each sequence's last row; every row of a
    speculative chain or tree, which are all verified)."""

    logits: torch.Tensor  # [rows, vocab]
    groups: list[tuple[Sequence, int]]  # (sequence, its rows), in row order
    hidden: torch.Tensor | None = None  # [rows, hidden] final hidden states, when asked for (Medusa)


class ModelRunner:
    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, num_host_blocks: int = 0, kv_cache_dtype: str = "auto"
    ):
        self.model = fuse_residual_norms(model.eval())
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.device.type == "cpu":
            keep_freed_memory()
            if self.dtype == torch.float32:  # the C++ decode kernel's only dtype: build/load it now, not on a request
                cpu_kernels()
        self.block_size = block_size
        pool_dtype, width = pool_layout(kv_cache_dtype, self.dtype, cfg.head_dim)
        shape = (cfg.num_key_value_heads, width)
        # Zero-filled: padded block-table entries may be read (and masked), never as NaN.
        self.kv_caches = [
            (
                torch.zeros(num_blocks, block_size, *shape, dtype=pool_dtype, device=self.device),
                torch.zeros(num_blocks, block_size, *shape, dtype=pool_dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        pin = self.device.type == "cuda"
        self.host_caches = (
            [
                (
                    torch.zeros(num_host_blocks, block_size, *shape, dtype=pool_dtype, pin_memory=pin),
                    torch.zeros(num_host_blocks, block_size, *shape, dtype=pool_dtype, pin_memory=pin),
                )
                for _ in range(cfg.num_hidden_layers)
            ]
            if num_host_blocks
            else []
        )
        self.attn = PagedAttention(self.kv_caches, kv_cache_dtype)

    # ------------------------------------------------------------------------------ block ops
    def apply_block_ops(self, ops: BlockOps) -> None:
        """Swap-outs first: a block freed by one may be reused by a swap-in or copy this step."""
        for pairs, src_pools, dst_pools in (
            (ops.swap_out, self.kv_caches, self.host_caches),
            (ops.swap_in, self.host_caches, self.kv_caches),
            (ops.copies, self.kv_caches, self.kv_caches),
        ):
            if not pairs:
                continue
            src = torch.tensor([a for a, _ in pairs])
            dst = torch.tensor([b for _, b in pairs])
            for (sk, sv), (dk, dv) in zip(src_pools, dst_pools):
                dk[dst.to(dk.device)] = sk[src.to(sk.device)].to(dk.device)
                dv[dst.to(dv.device)] = sv[src.to(sv.device)].to(dv.device)
        for blocks, shift in ops.rerotations:
            self._rerotate(blocks, shift)

    def _rerotate(self, blocks: list[int], shift: int) -> None:
        """Move cached keys `shift` positions left: RoPE(p - s) = RoPE(-s) . RoPE(p)."""
        inv_freq = self.model.model.inv_freq.to(self.device)
        angle = torch.cat([inv_freq, inv_freq]) * -float(shift)
        cos, sin = angle.cos().to(self.dtype), angle.sin().to(self.dtype)
        idx = torch.tensor(blocks, device=self.device)
        for k_cache, _ in self.kv_caches:
            k = k_cache[idx]
            k_cache[idx] = k * cos + rotate_half(k) * sin

    # ------------------------------------------------------------------------------ one step
    def prepare(self, scheduled: list[tuple[Sequence, int]], positions_in_cache: bool, window_in_cache: bool):
        """Pack decode rows (single new tokens, and every row of a chunk of at most DECODE_ROWS
        tokens: speculative chains, prompt tails), then longer prefill chunks, then speculative
        trees. A chunk's K/V are written to the cache before attention, so its row i is exactly a
        decode over the cache up to itself (context prefix + i + 1): the decode kernel serves it
        without the prefill path's per-sequence prefix gather.
        Returns (ids, positions, metadata, [(seq, rows to sample)])."""
        bs = self.block_size
        trees = [x for x in scheduled if x[0].spec_parents is not None]
        chains = [x for x in scheduled if x[0].spec_parents is None]
        order = [x for x in chains if x[1] <= DECODE_ROWS] + [x for x in chains if x[1] > DECODE_ROWS] + trees
        ids, positions, slots, sample = [], [], [], []
        dec_tables, dec_lens, pre_tables, pre_prefix, cu, tree_md = [], [], [], [], [0], []
        for seq, n in order:
            start = seq.num_computed_tokens
            first_cached = start - seq.num_evicted_tokens  # index of this chunk's first token in the cache
            row0 = len(ids)
            ids += (seq.token_ids + seq.spec_token_ids)[start : start + n]
            base = first_cached if positions_in_cache else start
            if seq.spec_parents is not None:
                depth = tree_depths(seq.spec_parents)
                positions += [base] + [base + d for d in depth]
                tree_md.append(
                    TreeGroup(row0, n, seq.block_table, first_cached, [0] + depth, ancestor_mask(seq.spec_parents))
                )
            else:
                positions += range(base, base + n)
            for c in range(first_cached, first_cached + n):
                slots.append(seq.block_table[c // bs] * bs + c % bs)
            if seq.spec_parents is None and n <= DECODE_ROWS:
                dec_tables += [seq.block_table] * n
                dec_lens += range(first_cached + 1, first_cached + n + 1)
            elif seq.spec_parents is None:
                pre_tables.append(seq.block_table)
                pre_prefix.append(first_cached)
                cu.append(cu[-1] + n)
            if seq.spec_token_ids:
                sample.append((seq, list(range(row0, row0 + n))))  # every proposal is checked
            elif start + n == seq.num_tokens:
                sample.append((seq, [len(ids) - 1]))
        dev = self.device

        def table(rows: list[list[int]]) -> torch.Tensor:
            width = max((len(r) for r in rows), default=0)
            return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=dev).reshape(
                len(rows), width
            )

        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decodes=len(dec_lens),
            decode_block_tables=table(dec_tables),
            decode_context_lens=torch.tensor(dec_lens, dtype=torch.int32, device=dev),
            prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_block_tables=table(pre_tables),
            prefill_prefix_lens=torch.tensor(pre_prefix, dtype=torch.int32, device=dev),
            max_prefill_len=max((b - a for a, b in zip(cu, cu[1:])), default=0),
            window_in_cache=window_in_cache,
            trees=tree_md,
        )
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        pos = torch.tensor([positions], dtype=torch.long, device=dev)
        return input_ids, pos, md, sample

    @torch.inference_mode()
    def execute(
        self,
        scheduled: list[tuple[Sequence, int]],
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
    ) -> ExecuteResult:
        """Run the step (hidden states are returned only with return_hidden)."""
        input_ids, positions, md, sample = self.prepare(scheduled, positions_in_cache, window_in_cache)
        self.attn.metadata = md
        try:
            hidden = self.model.hidden(input_ids, positions, attn=self.attn)[0]
        finally:
            self.attn.metadata = None
        rows = torch.tensor([r for _, rs in sample for r in rs], dtype=torch.long, device=self.device)
        picked = hidden[rows]
        logits = self.model.compute_logits(picked)
        groups = [(seq, len(rs)) for seq, rs in sample]
        return ExecuteResult(logits, groups, picked if return_hidden else None)

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy K/V between cache slots (compacting an accepted tree path into a chain)."""
        if not src:
            return
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat[d] = flat[s].clone()
