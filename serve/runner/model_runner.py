"""Owns the KV pools and runs one scheduled step of the shared model through paged attention.

With tensor/pipeline parallelism (serve/parallel/) every rank has a ModelRunner over its shard:
its pipeline stage's layers (`layers`), its attention heads, and KV pools for exactly those.

A model that mixes sliding-window and full layers may keep two KV groups (serve/scheduling/window_blocks.py):
given `window_blocks`, its sliding layers' pools have that many blocks of their own, addressed by
the chunks' window tables (the plan's WindowPlan), and every block op says which group it is for.

A model of multi-head latent attention (DeepSeek-V3) keeps one pool per layer of latent rows
(kv_lora_rank + qk_rope_head_dim values a token: `cache_layout`), attended by LatentPagedAttention
(serve/runner/mla_attention.py); its block ops move that one tensor where others move K and V.

A hybrid model (Bamba) has KV pools for its attention layers only, and a StatePool
(serve/runner/state_pool.py) of recurrent-state slots for its Mamba2 mixers; the engine binds the
BlockManager's StateSlots, which say each scheduled sequence's slot.

A step with prefill chunks samples one row per finished prompt (none for a chunk that ends
mid-prompt), yet every row's output of the last layer would be computed for nothing: only its K/V
(written by that layer's attention) are read later. So the last layer runs its attention, output
projection and MLP for the sampled rows alone (`answer_sampled_rows`; the backend's query_rows),
which takes nearly 1/num_layers of a prompt token's FLOPs off (the fused q/k/v projection still
runs for every row): 11% of the 110M serving model's, 14% of the 25M's, and prefill ran 1.07-1.22x
faster (docs/benchmarks.md, "The last layer for the sampled rows only"). Decode steps sample every
row and run unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from baton.common.mla import MLAttention
from baton.common.model import CausalLM, fuse_residual_norms, run_layers
from baton.kernels.cpu_extension import cpu_kernels
from baton.kernels.linear_cpu import pack_linears
from baton.kernels.reference import rotate_half
from baton.serve.core.sequence import Sequence
from baton.serve.quantization.kv_cache import pool_layout
from baton.serve.runner.attention import PagedAttention
from baton.serve.runner.cpu_layers import bind as bind_cpu_layers
from baton.serve.runner.cpu_layers import bind_head as bind_cpu_head
from baton.serve.runner.fusion import fuse_projections
from baton.serve.runner.input_batch import InputBatch
from baton.serve.runner.mla_attention import LatentPagedAttention, absorbed_weights, latent_width
from baton.serve.runner.state_pool import PagedHybridAttention, Segment, StatePool
from baton.serve.runner.step_plan import DECODE_ROWS, StepPlan
from baton.serve.scheduling.block_manager import BlockOps
from baton.serve.scheduling.state_slots import StateSlots

log = logging.getLogger(__name__)

__all__ = ["DECODE_ROWS", "ExecuteResult", "ModelRunner", "StepPass", "cache_layout", "kv_block_bytes"]


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


def cache_layout(
    cfg, dtype: torch.dtype, kv_cache_dtype: str = "auto", num_kv_heads: int | None = None
) -> tuple[torch.dtype, list[tuple[int, ...]]]:
    """(element dtype, the per-token shape of each pool tensor) of one attention layer's cache: a K and
    a V pool of [kv heads, head_dim] rows, or for MLA one pool of latent rows [kv_lora_rank +
    qk_rope_head_dim] (mla_attention.py; the same on every tensor rank: the latent is not split)."""
    if cfg.is_mla:
        return dtype, [(latent_width(cfg),)]
    pool_dtype, width = pool_layout(kv_cache_dtype, dtype, cfg.head_dim)
    heads = cfg.num_key_value_heads if num_kv_heads is None else num_kv_heads
    return pool_dtype, [(heads, width)] * 2


def kv_block_bytes(
    model: CausalLM,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
) -> int:
    """Bytes of one KV block over `num_layers` layers of `num_kv_heads` heads (default: the whole
    model's attention layers), from the layers' cache layout."""
    cfg = model.config
    pool_dtype, shapes = cache_layout(cfg, dtype, kv_cache_dtype, num_kv_heads)
    elem = torch.tensor([], dtype=pool_dtype).element_size()
    attn_layers = sum(cfg.is_attention_layer(i) for i in range(cfg.num_hidden_layers))
    layers = attn_layers if num_layers is None else num_layers
    return layers * block_size * sum(math.prod(s) for s in shapes) * elem


@dataclass
class ExecuteResult:
    """One step's output for the rows that are sampled (each sequence's last row; every row of a
    speculative chain or tree, which are all verified)."""

    logits: torch.Tensor  # [rows, vocab]
    groups: list[tuple[Sequence, int]]  # (sequence, its rows), in row order
    hidden: torch.Tensor | None = None  # [rows, hidden] final hidden states, when asked for (Medusa)


class StepPass(Protocol):
    """Runs a step's layers its own way, installed on a runner from outside (LayerSkip's late entry,
    serve/runner/late_entry.py): returns what forward(plan, sampled_only=answer_sampled_rows) would."""

    def __call__(self, plan: StepPlan, positions_in_cache: bool) -> torch.Tensor: ...


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        kv_cache_dtype: str = "auto",
        layers: range | None = None,
        states: StateSlots | None = None,
        window_blocks: int = 0,
        window_host_blocks: int = 0,
    ):
        """`layers`: the global indices of the decoder layers this runner holds (a pipeline stage);
        default all. Their attention modules give the (possibly sharded) KV head count. A hybrid
        model needs `states`, the BlockManager's record of the state slots: it sizes the pool and
        says each scheduled sequence's slot. `window_blocks` > 0: the sliding-window layers' own
        KV group of that many blocks (and `window_host_blocks` to swap to); 0: one group."""
        self.model = fuse_projections(fuse_residual_norms(model.eval()))
        cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.layer_ids = range(cfg.num_hidden_layers) if layers is None else layers
        self.layers = [self.model.model.layers[i] for i in self.layer_ids]
        # MLA: kv_b_proj's per-head halves for weight absorption, taken while its weight is plain
        # (every MLA module's: the MTP blocks' are the MTP proposer's)
        for a in (m for m in self.model.modules() if isinstance(m, MLAttention)):
            absorbed_weights(a)
        if self.device.type == "cpu":
            keep_freed_memory()
            if self.dtype in (torch.float32, torch.bfloat16):  # the C++ decode kernel's dtypes: build/load it now
                cpu_kernels()
            pack_linears(self.model)  # oneDNN (bf16) / MKL (fp32) pack a plain weight on every call: once, here
        self.block_size, self.num_blocks, self.num_host_blocks = block_size, num_blocks, num_host_blocks
        kv_heads = next(x.self_attn for x in self.layers if hasattr(x, "self_attn")).num_kv_heads
        pool_dtype, shapes = cache_layout(cfg, self.dtype, kv_cache_dtype, kv_heads)
        pin = self.device.type == "cuda"

        mine = [i for i in self.layer_ids if cfg.is_attention_layer(i)]
        self.num_window_blocks, self.num_window_host_blocks = window_blocks, window_host_blocks
        # the layers whose pools each group's block ids address
        self.window_layers = [i for i in mine if window_blocks and cfg.is_sliding(i)]
        self.full_layers = [i for i in mine if i not in self.window_layers]

        def pools(n: int, n_window: int, device, pin_memory: bool = False) -> list[tuple[torch.Tensor, ...] | None]:
            # Zero-filled: padded block-table entries may be read (and masked), never as NaN. Indexed
            # by global layer; None for the layers other pipeline stages hold and for mixer layers.
            def pool(i: int) -> tuple[torch.Tensor, ...]:
                size = n_window if i in self.window_layers else n
                return tuple(
                    torch.zeros(size, block_size, *shape, dtype=pool_dtype, device=device, pin_memory=pin_memory)
                    for shape in shapes
                )

            return [pool(i) if i in mine else None for i in range(cfg.num_hidden_layers)]

        self.kv_caches = pools(num_blocks, window_blocks, self.device)
        self.host_caches = (
            pools(num_host_blocks, window_host_blocks, "cpu", pin) if num_host_blocks or window_host_blocks else []
        )
        self.state_slots = states
        mixers = {i: x.mamba for i, x in zip(self.layer_ids, self.layers) if hasattr(x, "mamba")}
        if mixers:
            if states is None:
                raise ValueError(f"a hybrid model ({cfg.model_type}) needs recurrent-state slots for its mixers")
            num = states.num_slots + states.num_snapshots
            self.state_pool = StatePool(mixers, num, states.num_host, self.device, self.dtype, pin)
            self.attn = PagedHybridAttention(self.kv_caches, kv_cache_dtype, self.state_pool)
        elif cfg.is_mla:  # one latent pool per layer (mla_attention.py)
            self.attn = LatentPagedAttention(self.kv_caches)
        else:
            self.attn = PagedAttention(self.kv_caches, kv_cache_dtype)
        # On CPU a step's layers run without the modules' Python between kernels where they can (cpu_layers.py).
        # (not with KV groups: the C++ stack reads one slot mapping and one set of tables for every layer)
        self.cpu_layers = (
            None if self.window_layers else bind_cpu_layers(self.layers, self.attn, self.device, self.dtype)
        )
        # (only where the logits are lm_head(hidden): a compute_logits of its own would be bypassed)
        plain_logits = getattr(type(self.model), "compute_logits", None) is CausalLM.compute_logits
        plain_logits = plain_logits and cfg.final_logit_softcapping is None
        head = getattr(self.model, "lm_head", None) if plain_logits else None
        self.cpu_head = (
            None if head is None else bind_cpu_head(self.model.model.final_norm, head, self.device, self.dtype)
        )
        self.inputs = InputBatch(self.device)  # the step tensors, block-table rows kept between steps
        self.step_pass: StepPass | None = None  # installed from outside; None: forward_step's own way
        # The last layer for the sampled rows only (module docstring): where the runner holds it,
        # the backend is plain paged attention over an unquantized cache (a hybrid's last layer
        # may be a mixer; a quantized cache attends a chunk to its own K/V unrounded).
        last = cfg.num_hidden_layers - 1
        self.answer_sampled_rows = (
            self.layer_ids.stop == cfg.num_hidden_layers
            and type(self.attn) in (PagedAttention, LatentPagedAttention)
            and kv_cache_dtype == "auto"
            and hasattr(self.model.model.layers[last], "self_attn")
        )

    # ------------------------------------------------------------------------------ block ops
    def apply_block_ops(self, ops: BlockOps) -> None:
        """Swap-outs first: a block freed by one may be reused by a swap-in or copy this step. The
        full layers' ops, then (KV groups) the sliding-window layers' with their own block ids."""
        self._move_blocks(ops, self.full_layers)
        if ops.window is not None:
            self._move_blocks(ops.window, self.window_layers)
        for blocks, shift in ops.rerotations:
            self._rerotate(blocks, shift)
        if ops.state_ops:
            self.state_pool.apply(ops.state_ops)

    def _move_blocks(self, ops: BlockOps, layers: list[int]) -> None:
        for pairs, src_pools, dst_pools in (
            (ops.swap_out, self.kv_caches, self.host_caches),
            (ops.swap_in, self.host_caches, self.kv_caches),
            (ops.copies, self.kv_caches, self.kv_caches),
        ):
            if not pairs:
                continue
            src = torch.tensor([a for a, _ in pairs])
            dst = torch.tensor([b for _, b in pairs])
            for i in layers:  # K and V pools, or an MLA layer's one latent pool
                for s, d in zip(src_pools[i], dst_pools[i]):
                    d[dst.to(d.device)] = s[src.to(s.device)].to(d.device)

    def _rerotate(self, blocks: list[int], shift: int) -> None:
        """Move cached keys `shift` positions left: RoPE(p - s) = RoPE(-s) . RoPE(p)."""
        inv_freq = self.model.model.inv_freq.to(self.device)
        angle = torch.cat([inv_freq, inv_freq]) * -float(shift)
        cos, sin = angle.cos().to(self.dtype), angle.sin().to(self.dtype)
        idx = torch.tensor(blocks, device=self.device)
        for k_cache, _ in filter(None, self.kv_caches):
            k = k_cache[idx]
            k_cache[idx] = k * cos + rotate_half(k) * sin

    # ------------------------------------------------------------------------------ one step
    def plan(
        self,
        scheduled: list[tuple[Sequence, int]],
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
    ) -> tuple[StepPlan, list[tuple[Sequence, int]]]:
        return StepPlan.build(scheduled, self.block_size, positions_in_cache, window_in_cache, return_hidden)

    @torch.inference_mode()
    def forward(
        self,
        plan: StepPlan,
        hidden: torch.Tensor | None = None,
        layers: range | None = None,
        sampled_only: bool = False,
    ) -> torch.Tensor:
        """This runner's layers (or the global `layers`, a part of them) over the plan's tokens:
        from the embedding, or from `hidden` [1, T, hidden], the input of the first of them (the
        previous pipeline stage's output; a step pass's rows entering at a later layer). Returns
        [1, T, hidden]; with `sampled_only` (where answer_sampled_rows), the sampled rows' alone,
        [1, S, hidden], when they are fewer."""
        input_ids, positions, md = self.inputs.tensors(plan)
        inner = self.model.model
        if inner.inv_freq.device != self.device:
            inner.inv_freq = inner.inv_freq.to(self.device)
        x = inner.embed(input_ids) if hidden is None else hidden
        mods = self.layers
        if layers is not None:
            first = self.layer_ids.start
            mods = self.layers[layers.start - first : layers.stop - first]
        last = self.layer_ids.stop - 1
        runs_last = layers is None or layers.stop == last + 1
        self.attn.metadata = md
        try:  # set and cleared together, so a step that fails leaves nothing for the next one
            if sampled_only and runs_last and len(plan.sample_rows) < plan.num_tokens and not plan.trees:
                self.attn.query_rows = torch.tensor(plan.sample_rows, dtype=torch.long, device=self.device)
                self.attn.query_rows_layer = last
            if self.cpu_layers is not None and self.cpu_layers.takes(mods, md):
                return self.cpu_layers.run(mods, x, positions, inner.inv_freq, md)
            return run_layers(mods, x, positions, inner.inv_freq, self.attn)
        finally:
            self.attn.metadata = self.attn.query_rows = None

    def forward_step(self, plan: StepPlan, positions_in_cache: bool = False) -> torch.Tensor:
        """Every layer of this runner over the step's rows, from the embedding (the last layer for the
        sampled rows alone where it can): by the step pass installed from outside, if one is."""
        if self.step_pass is not None:
            return self.step_pass(plan, positions_in_cache)
        return self.forward(plan, sampled_only=self.answer_sampled_rows)

    @torch.inference_mode()
    def head(self, plan: StepPlan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [rows, vocab], final hidden states [rows, hidden] when the plan asks) of the
        rows to sample (x: every row's, or the sampled rows' alone). RMSNorm is per row, so only
        the sampled rows are normalised."""
        r = plan.sample_rows
        if x.shape[1] != plan.num_tokens:  # forward(sampled_only=True) answered those rows alone
            picked = x[0]
        elif r and r[-1] - r[0] == len(r) - 1:  # consecutive rows (every row at decode): a view, no gather
            picked = x[0, r[0] : r[-1] + 1]
        else:
            picked = x[0][torch.tensor(r, dtype=torch.long, device=self.device)]
        if self.cpu_head is not None and self.cpu_head.takes():
            logits, picked = self.cpu_head(picked)
        else:
            picked = self.model.model.final_norm(picked)
            logits = self.model.compute_logits(picked)
        return logits, picked if plan.return_hidden else None

    def execute(
        self,
        scheduled: list[tuple[Sequence, int]],
        positions_in_cache: bool = False,
        window_in_cache: bool = True,
        return_hidden: bool = False,
    ) -> ExecuteResult:
        """Run the step (hidden states are returned only with return_hidden)."""
        plan, groups = self.plan(scheduled, positions_in_cache, window_in_cache, return_hidden)
        if self.state_slots is not None:
            self._begin_states(plan)
        logits, hidden = self.head(plan, self.forward_step(plan, positions_in_cache))
        return ExecuteResult(logits, groups, hidden)

    max_in_flight = 1  # in-process: each step runs to its end (Runner.submit is execute)

    def submit(self, *args) -> ExecuteResult:
        return self.execute(*args)

    def collect(self, result: ExecuteResult) -> ExecuteResult:
        return result

    def check_health(self) -> None:
        """Nothing of an in-process model can be lost between steps."""

    def shutdown(self) -> None:
        """Nothing was started: the pools go with the runner."""

    def _begin_states(self, plan: StepPlan) -> None:
        """The mixers' view of the step: each chunk's rows and slot (zeroed for a sequence's first
        chunk), in the plan's packing order."""
        slots, segments, fresh, row = self.state_slots, [], [], 0
        for c in plan.chunks:
            slot, n = slots.slot_of[c.seq_id], len(c.tokens)
            if c.start == 0:
                fresh.append(slot)
            snap = [(p - c.start, s) for p, s in slots.snapshots_at(c.seq_id) if c.start < p <= c.start + n]
            segments.append(Segment(c.seq_id, row, n, slot, c.sample == "all", snap))
            row += n
        self.state_pool.zero(fresh)
        self.attn.begin(segments)

    def keep_state(self, seq_id: int, num_accepted: int) -> None:
        """After a speculative chunk's verification: its state is the one at the last accepted token."""
        if self.state_slots is not None:
            self.attn.keep_state(seq_id, num_accepted)

    def release(self, seq_id: int) -> None:
        """A sequence left the engine: its block-table row is freed (the distributed runner's
        workers forget theirs through its TableSender); a speculative state not kept is dropped."""
        self.inputs.release(seq_id)
        if self.state_slots is not None:
            self.attn.spec_states.pop(seq_id, None)

    def move_slots(
        self, src: list[int], dst: list[int], window_src: list[int] | None = None, window_dst: list[int] | None = None
    ) -> None:
        """Copy K/V between cache slots (compacting an accepted tree path into a chain); with KV
        groups the sliding-window layers' slots are window_src/window_dst."""
        for layers, a, b in ((self.full_layers, src, dst), (self.window_layers, window_src, window_dst)):
            if not a or not layers:
                continue
            s, d = torch.tensor(a, device=self.device), torch.tensor(b, device=self.device)
            for i in layers:
                for cache in self.kv_caches[i]:
                    flat = cache.view(-1, *cache.shape[2:])
                    flat[d] = flat[s].clone()
