"""Iteration-level scheduler (continuous batching) with chunked prefill and preemption.

Every step has a token budget. Running sequences are served first — decodes and unfinished
prefill chunks together — so a long prompt can never stall the decodes; what budget is left
admits swapped-out and then waiting sequences, chunking a prompt that does not fit. When blocks
run out, the lowest-priority running sequence is preempted: by recompute (drop its KV, re-prefill
later) or by swap (copy its KV to the host pool), per policy.

A request with n > 1 samples is admitted as one sequence that forks after its prompt: it holds n
of the max_num_seqs slots from admission on, so the forks never overfill the batch.

The schedule carries the KV work its forward needs first (swaps, copy-on-write copies,
StreamingLLM re-rotations); after the forward, postprocess() books what was computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from baton.serve.core.faults import SequenceFailure
from baton.serve.core.sequence import Sequence, SequenceStatus
from baton.serve.core.token_tree import clear_speculation
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.block_manager import BlockManager, BlockOps
from baton.serve.scheduling.streaming import EvictionPolicy
from baton.serve.scheduling.window_blocks import window_blocks_bound


def slots(seq: Sequence) -> int:
    """Batch slots a sequence takes: the first sample of an n > 1 request forks into n after its prompt."""
    return seq.params.n if seq.index == 0 and seq.num_output_tokens == 0 else 1


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # "recompute" | "swap" (falls back to recompute if the host pool is full)
    policy: str = "fcfs"  # "fcfs" | "priority" (lower priority value runs first)
    priority_aging_s: float = 30.0  # each this many seconds of waiting raises priority by one: no starvation

    def validate(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    block_ops: BlockOps = field(default_factory=BlockOps)  # to apply before the forward

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eviction: EvictionPolicy | None = None):
        config.validate()
        self.config = config
        self.bm = block_manager
        self.eviction = eviction
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def check_fits(self, num_prompt: int, params: SamplingParams, max_model_len: int) -> None:
        """ValueError for a request that could never be scheduled: alone, with the whole pool free,
        each of its steps must fit (it would stall the queue forever otherwise)."""
        bs, pool = self.bm.block_size, self.bm.num_blocks
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n is {params.n}, more than the {self.config.max_num_seqs} sequences a batch holds (max_num_seqs)"
            )
        cached = num_prompt + params.max_tokens - 1  # the last token's KV is never computed
        chunked = self.config.enable_chunked_prefill
        bound = self.eviction.cached_bound(num_prompt, bs, chunked) if self.eviction is not None else None
        cached = min(cached, max_model_len - 1 if bound is None else bound)
        if -(-cached // bs) > pool:
            raise ValueError(
                f"the KV cache ({pool} blocks of {bs}) cannot hold one sequence of {cached} cached "
                "tokens: raise the KV budget or lower max_tokens"
            )
        win = self.bm.window
        if win is not None:  # the sliding layers' group holds its window and one step's chunk (at most)
            need = min(-(-cached // bs), window_blocks_bound(win.window, bs, self.config.max_num_batched_tokens))
            if need > win.num_blocks:
                raise ValueError(
                    f"the sliding-window layers' KV group ({win.num_blocks} blocks of {bs}) cannot hold one "
                    f"sequence's window of {win.window} tokens and a step's chunk ({need} blocks): raise the "
                    "KV budget or lower max_num_batched_tokens"
                )
        # Forked after the prompt, each sample writes its next token's KV into a block of its own; with
        # fewer blocks the samples would only ever run one after another, re-prefilling.
        if params.n > 1 and cached > num_prompt and num_prompt // bs + params.n > pool:
            raise ValueError(
                f"n={params.n} samples need {num_prompt // bs} shared prompt blocks plus one block "
                f"each, more than the KV cache's {pool}: lower n or raise the KV budget"
            )

    def _key(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        if self.config.policy == "priority":
            aged = seq.priority - (now - seq.arrival_time) / self.config.priority_aging_s
            return (aged, seq.arrival_time, seq.seq_id)
        return (0.0, seq.arrival_time, seq.seq_id)

    # ---------------------------------------------------------------------------------- step
    def schedule(self, exclude: set[int] = frozenset(), max_seqs: int | None = None) -> SchedulerOutput:
        """`exclude`: ids of running sequences in a batch still in flight (pipelined steps): they
        are neither scheduled nor preempted. `max_seqs`: at most this many sequences this step
        (pipelined steps split the sequences between the batches in flight)."""
        cap = max_seqs if max_seqs is not None else self.config.max_num_seqs
        now = time.monotonic()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: self._key(s, now))

        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < cap:
            seq = self.running[i]
            if seq.seq_id in exclude:
                i += 1
                continue
            if self.eviction is not None:
                self.eviction.evict(seq, self.bm)
            n = self._chunk(seq, budget)
            if n == 0:
                i += 1
                continue
            while not self.bm.allocate_slots(seq, n):
                victim = next(s for s in reversed(self.running) if s.seq_id not in exclude)  # lowest priority
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                i += 1

        used, limit = sum(map(slots, self.running)), self.config.max_num_seqs
        if not out.preempted:  # resume before admitting: swapped sequences are older
            self.swapped.sort(key=lambda s: self._key(s, now))
            while self.swapped and budget > 0 and used + slots(self.swapped[0]) <= limit and len(out.scheduled) < cap:
                seq = self.swapped[0]
                n = self._chunk(seq, budget)
                if n == 0 or not self.bm.can_swap_in(seq, n):
                    break
                self.bm.swap_in(seq)
                if not self.bm.allocate_slots(seq, n):
                    raise AssertionError("can_swap_in promised room for the new tokens")
                self.swapped.pop(0)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append((seq, n))
                budget -= n
                used += slots(seq)

        if not out.preempted and not self.swapped:
            self.waiting.sort(key=lambda s: self._key(s, now))
            while self.waiting and budget > 0 and used + slots(self.waiting[0]) <= limit and len(out.scheduled) < cap:
                seq = self.waiting[0]
                hit = self.bm.match_prefix(seq)  # waiting sequences hold no blocks
                seq.num_computed_tokens = hit
                n = self._chunk(seq, budget)
                if n == 0 or not self.bm.allocate_slots(seq, n):
                    self.bm.free(seq)
                    seq.num_computed_tokens = 0
                    break
                self.waiting.pop(0)
                seq.status = SequenceStatus.RUNNING
                if seq.metrics.first_scheduled_time is None:
                    seq.metrics.first_scheduled_time = now
                    seq.metrics.num_cached_prompt_tokens = hit
                    self.bm.record_prefix_lookup(seq.num_tokens, hit)
                self.running.append(seq)
                out.scheduled.append((seq, n))
                budget -= n
                used += slots(seq)
        if out.scheduled:  # else the work waits for the next step that runs (a swap-out before its swap-in)
            out.block_ops = self.bm.take_pending()
            if self.eviction is not None:
                out.block_ops.rerotations = self.eviction.take_rerotations()
        return out

    def postprocess(self, out: SchedulerOutput, fail: SequenceFailure) -> None:
        """After the forward: the scheduled tokens' KV is cached, and newly full blocks go to the
        prefix cache. Speculative sequences advance in verification instead, by what is accepted.
        A raise fails that sequence's request only."""
        for seq, n in out.scheduled:
            if seq.is_finished:  # aborted while its batch was in flight
                continue
            if not seq.spec_token_ids:
                seq.num_computed_tokens += n
                if seq.num_computed_tokens <= seq.num_prompt_tokens:
                    self.num_computed_prompt_tokens += n
                try:
                    self.bm.register_full_blocks(seq)
                except Exception as e:
                    fail(seq, "postprocess", e)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        if self.eviction is not None:  # eviction frees room between steps, but one step must fit the pool
            in_cache = seq.num_computed_tokens - seq.num_evicted_tokens  # (a long prompt is chunked)
            remaining = min(remaining, self.bm.num_blocks * self.bm.block_size - in_cache)
        if seq.spec_token_ids:  # speculative proposals ride along with the decode, budget permitting
            keep = max(0, min(len(seq.spec_token_ids), budget - remaining))
            if keep < len(seq.spec_token_ids):
                clear_speculation(seq, keep)
            remaining += len(seq.spec_token_ids)
        if self.config.enable_chunked_prefill or remaining > self.config.max_num_batched_tokens:
            # (a recompute-preempted sequence may have outgrown the budget: chunk it regardless)
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _preempt(self, seq: Sequence) -> None:
        clear_speculation(seq)
        self.num_preemptions += 1
        seq.metrics.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.bm.can_swap_out(seq) and seq.num_evicted_tokens == 0:
            self.bm.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            seq.num_evicted_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)

    # ---------------------------------------------------------------------------------- retire
    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and give back every block it held."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.bm.free(seq)
        self.bm.free_host(seq)
        seq.status = SequenceStatus.FINISHED
