"""LLMEngine: requests in, one scheduled model step at a time, outputs out (vLLM's shape).

step() = schedule (continuous batching; serve/scheduling/) -> execute the packed batch on the
Runner (serve/runner/interface.py) -> postprocess: book the computed KV, verify speculative
proposals (serve/speculative/), sample, and hand each token to the OutputProcessor (append,
detokenize, stop conditions; serve/engine/output.py) -> retire finished sequences (freeing
blocks). The pipelined step keeps up to the runner's max_in_flight batches submitted. What the
engine's features cannot be combined with is checked once, before anything is built
(serve/engine/rules.py); the pools are sized by serve/engine/sizing.py.

A request can fail only itself. A raise in one sequence's work (proposal, sampling, appending,
detokenizing, stop checks, verification, output building) retires that request through the
scheduler (its blocks are free at once) and step() reports it: a final RequestOutput with `error`
and finish_reason "error" (AsyncLLMEngine raises RequestFailedError in that stream only). Batched
proposals/sampling that raise are retried per sequence (a seeded draw made before the raise is
drawn again); a raising forward fails exactly its batch. Then the KV pools are recounted
(BlockManager.problem, serve/core/faults.py): only a count that does not add up, or a raise while
failing a request, escapes step() as EngineFault - the engine is dead. Admission refuses what
could never be scheduled; if the scheduler still makes no progress, the request at the head of
the queue fails.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import time
from pathlib import Path

import torch
from baton.common.checkpoint import read_config
from baton.common.model import CausalLM
from baton.common.tokenizer import Tokenizer
from baton.serve.core.faults import EngineFault, FaultInjector, injector_from_env, per_sequence
from baton.serve.core.request_state import RequestState
from baton.serve.core.sequence import Sequence, SequenceStatus
from baton.serve.core.stats import EngineStats
from baton.serve.engine.config import EngineConfig
from baton.serve.engine.output import OutputProcessor
from baton.serve.engine.rules import check as check_rules
from baton.serve.engine.sizing import kv_group_window, plan_model_pools
from baton.serve.grammar import GrammarCache, prune_proposals
from baton.serve.outputs import RequestOutput
from baton.serve.quantization.kv_cache import check_kv_cache_dtype
from baton.serve.quantization.loader import load_model  # float or quantized checkpoints
from baton.serve.runner.early_exit import apply_early_exit
from baton.serve.runner.interface import Runner
from baton.serve.runner.model_runner import ExecuteResult, ModelRunner
from baton.serve.sampler import SampleResult, sample
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.block_manager import BlockManager
from baton.serve.scheduling.scheduler import Scheduler, SchedulerOutput
from baton.serve.scheduling.streaming import SlidingWindowPolicy, StreamingLLMPolicy
from baton.serve.scheduling.window_blocks import WindowBlocks
from baton.serve.speculative.config import SpecStats
from baton.serve.speculative.decoder import SpeculativeDecoder
from baton.serve.speculative.registry import make_proposer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model: CausalLM | None,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        model_dir: str | Path | None = None,
        runner: ModelRunner | None = None,
    ):
        """`model` runs in this process; or pass a `runner` that already holds the model and its
        pools (serve/parallel/driver.py's DistributedRunner: the model is sharded over ranks)."""
        self.config = config = config or EngineConfig()
        config.validate()
        self.model, self.tokenizer = model, tokenizer
        mcfg = self.model_config = model.config if runner is None else runner.model_config
        check_rules(config, mcfg)
        check_kv_cache_dtype(config.kv_cache_dtype, mcfg.head_dim)
        self.vocab_size = mcfg.vocab_size
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        states = None
        # KV groups: a model mixing sliding-window and full layers frees the sliding ones' old blocks
        window = kv_group_window(config, mcfg)
        if runner is None:
            pools = plan_model_pools(config, model, window)
            states = pools.states
            runner = ModelRunner(
                model, pools.num_blocks, config.block_size, pools.num_host_blocks, config.kv_cache_dtype,
                states=states, window_blocks=pools.num_window_blocks, window_host_blocks=pools.num_window_host_blocks,
            )  # fmt: skip
        self.early_exit = None  # CALM confidence early exit: a runner wrapper (serve/runner/early_exit.py)
        if config.early_exit_threshold is not None:
            runner = self.early_exit = apply_early_exit(runner, config.early_exit_threshold)
        self.runner: Runner = runner
        num_blocks, num_host = runner.num_blocks, runner.num_host_blocks
        eviction = None
        if config.streaming:
            eviction = StreamingLLMPolicy(config.streaming_sink_tokens or 0, config.streaming_window_tokens)
        elif mcfg.sliding_window is not None and all(mcfg.is_sliding(i) for i in range(mcfg.num_hidden_layers)):
            eviction = SlidingWindowPolicy(mcfg.sliding_window)
        self.eviction = eviction
        prefix_caching = config.enable_prefix_caching and eviction is None
        window_group = None  # the sliding-window layers' blocks (a runner with pools for them)
        if window is not None and getattr(runner, "num_window_blocks", 0):
            window_group = WindowBlocks(
                runner.num_window_blocks, config.block_size, window, runner.num_window_host_blocks
            )
        self.block_manager = BlockManager(num_blocks, config.block_size, prefix_caching, num_host, states, window_group)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, eviction)
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        eos_ids = self._eos_ids()
        self.output = OutputProcessor(tokenizer, eos_ids, self.max_model_len, config.streaming, self._retire)
        self.grammars = GrammarCache(tokenizer, self.vocab_size, eos_ids)  # structured outputs
        self.fault_injector: FaultInjector | None = injector_from_env()  # tests: (point, seq) -> may raise
        self._failed: list[RequestState] = []  # failed during the current step, which reports them
        self.speculative: SpeculativeDecoder | None = None
        # Batches in flight at once: one per pipeline stage when the runner can overlap them (not
        # with speculation: proposals need the previous step's tokens).
        self._depth = runner.max_in_flight if config.speculative is None else 1
        self._in_flight: collections.deque[tuple[SchedulerOutput, object]] = collections.deque()
        if config.speculative is not None:
            proposer = make_proposer(
                config.speculative, model_dir, mcfg.vocab_size, runner.device, runner.dtype, model=model
            )
            self.speculative = SpeculativeDecoder(
                config.speculative, proposer, self.runner, self.block_manager, self.max_model_len
            )
        log.info(
            "KV cache: %d blocks of %d tokens, host swap pool %d blocks; prefix caching %s%s",
            num_blocks,
            config.block_size,
            num_host,
            "on" if prefix_caching else "off",
            f"; StreamingLLM sinks={config.streaming_sink_tokens} window={config.streaming_window_tokens}"
            if config.streaming
            else "",
        )

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, config: EngineConfig | None = None, device: str = "cpu", dtype: torch.dtype | None = None
    ) -> "LLMEngine":
        config = config or EngineConfig()
        tok = Tokenizer.from_dir(path) if (Path(path) / "tokenizer.json").is_file() else None
        if config.parallel.world_size > 1:
            from baton.serve.parallel import start_distributed

            check_rules(config, read_config(path), sharded=True)  # before any worker starts

            return cls(None, tok, config, model_dir=path, runner=start_distributed(path, config, device, dtype))
        ckpt = load_model(path, device=device, dtype=dtype)
        return cls(ckpt.model, tok, config, model_dir=path)

    def check_health(self) -> None:
        """Raises EngineFault when the model can no longer run (a sharded model's worker is gone)."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Stop what the engine started (a sharded model's worker processes)."""
        self.runner.shutdown()

    def _eos_ids(self) -> set[int]:
        eos = self.model_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------------------------ requests
    def validate_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids of the prompt, or ValueError naming what is wrong (nothing is scheduled)."""
        params.validate(self.vocab_size)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in 0..{self.vocab_size - 1}")
        if not ids:
            raise ValueError("prompt is empty")
        if not self.config.streaming and len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)"
            )
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and len(ids) > sched.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {len(ids)} tokens, more than max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}) with chunked prefill off"
            )
        if self.config.streaming and params.n != 1:
            raise ValueError("StreamingLLM mode generates one sample per request (n=1)")
        self.scheduler.check_fits(len(ids), params, self.max_model_len)
        if params.structured is not None:
            self.grammars.compile(params.structured)  # a spec xgrammar rejects fails here (cached for add_request)
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> None:
        """Queue a request; `final_only`: step() reports it once, finished (nothing to stream)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.validate_request(prompt, params)
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            0,
            ids,
            params,
            priority,
            arrival_time if arrival_time is not None else time.monotonic(),
        )
        seq.make_generator()
        seq.grammar = self.grammars.sequence_grammar(params)  # structured outputs after any thinking
        self.requests[request_id] = RequestState(
            request_id,
            prompt if isinstance(prompt, str) else None,
            ids,
            params,
            [seq],
            [self.output.detokenizer(params)],
            [""],
            [0],
            final_only=final_only,
        )
        self.scheduler.add(seq)

    @property
    def eos_ids(self) -> set[int]:
        return self.output.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.output.eos_ids = ids

    @property
    def num_generated_tokens(self) -> int:
        return self.output.num_generated_tokens

    def _append(self, req: RequestState, seq: Sequence, result: SampleResult, now: float) -> None:
        if self.fault_injector is not None:
            self.fault_injector("postprocess", seq)
        self.output.append(req, seq, result, now)

    def _place(self, parent: Sequence, child: Sequence) -> None:
        """A forked sample beside its parent: blocks shared, running (its slot was reserved with the parent)."""
        self.block_manager.fork(parent, child)
        self.scheduler.running.append(child)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            self._retire(seq, "abort")
        return req.output(final=True)

    def _retire(self, seq: Sequence, reason: str) -> None:
        """Out of the scheduler (its blocks go back) and out of speculation."""
        if self.speculative is not None:
            self.speculative.release(seq)
        if not seq.is_finished:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
        self.runner.release(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        """Queue, batch, KV and token numbers now (AsyncLLMEngine.snapshot reads them under its lock)."""
        bm, sched = self.block_manager, self.scheduler
        spec = self.speculative.stats if self.speculative is not None else SpecStats()
        return EngineStats(
            engine_requests=len(self.requests),
            waiting_seqs=len(sched.waiting),
            running_seqs=len(sched.running),
            swapped_seqs=len(sched.swapped),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_window_blocks_total=bm.window.num_blocks if bm.window is not None else 0,
            kv_window_blocks_free=bm.window.num_free_blocks if bm.window is not None else 0,
            prefix_cache_hit_rate=bm.prefix_hit_rate,
            preemptions=sched.num_preemptions,
            prompt_tokens=sched.num_computed_prompt_tokens,
            generation_tokens=self.num_generated_tokens,
            spec_proposed_tokens=spec.proposed,
            spec_accepted_tokens=spec.accepted,
            spec_acceptance_rate=spec.acceptance_rate,
            spec_mean_accepted_length=spec.mean_accepted_length,
            spec_proposed_by_depth=list(spec.proposed_by_depth),
            spec_accepted_by_depth=list(spec.accepted_by_depth),
            spec_method=self.config.speculative.method if self.config.speculative is not None else "none",
            spec_speedup=spec.speedup,
            **(self.early_exit.stats() if self.early_exit is not None else {}),
        )

    # ------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> postprocess; a failure is contained as the module docstring says."""
        if self._depth > 1:
            return self._pipelined_step()
        spec, start, generated = self.speculative, time.perf_counter(), self.num_generated_tokens
        if spec is not None:
            spec.propose(self.scheduler.running, self.fault_injector, self._fail_seq)
            prune_proposals(self.scheduler.running)  # structured outputs: only proposals the grammar allows
        sched = self.scheduler.schedule()
        timed = spec.decode_step_kind(sched.scheduled) if spec is not None else None  # the speed-up's clock
        touched: dict[str, RequestState] = {}
        if not sched.scheduled:
            if self.scheduler.has_work() and not sched.preempted:
                self._fail_unschedulable()
        elif (result := self._execute(sched, self.runner.execute)) is not None:
            self.scheduler.postprocess(sched, self._fail_seq)
            touched = self._append_tokens(result)
            if timed is not None:
                elapsed, tokens = time.perf_counter() - start, self.num_generated_tokens - generated
                spec.stats.time_step(len(sched.scheduled), timed, elapsed, tokens)
        return self._outputs(touched)

    def _pipelined_step(self) -> list[RequestOutput]:
        """Pipeline parallelism without idle stages (vLLM's virtual engines): up to one batch per
        stage in flight, each of sequences no other in-flight batch holds. A step submits a new batch
        while the pipe has room and there is work for it, else finishes the oldest batch."""
        if len(self._in_flight) < self._depth:
            busy = {seq.seq_id for s, _ in self._in_flight for seq, _ in s.scheduled}
            sc = self.scheduler
            active = min(len(sc.running) + len(sc.waiting) + len(sc.swapped), sc.config.max_num_seqs)
            sched = sc.schedule(exclude=busy, max_seqs=max(1, -(-active // self._depth)))
            if sched.scheduled:
                handle = self._execute(sched, self.runner.submit)
                if handle is not None:
                    self._in_flight.append((sched, handle))
                if len(self._in_flight) < self._depth:
                    return self._outputs({})
            elif not self._in_flight and self.scheduler.has_work() and not sched.preempted:
                self._fail_unschedulable()
        if not self._in_flight:
            return self._outputs({})
        sched, handle = self._in_flight.popleft()
        result = self.runner.collect(handle)  # a lost worker raises EngineFault: the engine is dead
        self.scheduler.postprocess(sched, self._fail_seq)
        return self._outputs(self._append_tokens(result))

    def _execute(self, sched: SchedulerOutput, run):
        """The step's block ops, then `run` (the runner's execute, or submit); None when either
        raised (then the requests in the batch have failed)."""
        positions_in_cache = bool(self.eviction and self.eviction.positions_in_cache)
        want_hidden = self.speculative is not None and self.speculative.wants_hidden
        applied = False
        try:
            self.runner.apply_block_ops(sched.block_ops)
            applied = True
            if self.fault_injector is not None:
                for seq, _ in sched.scheduled:
                    self.fault_injector("forward", seq)
            return run(sched.scheduled, positions_in_cache, not positions_in_cache, want_hidden)
        except EngineFault:  # the runner itself is broken (a sharded model lost a worker): the engine is dead
            raise
        except Exception as e:
            hit = [seq for seq, _ in sched.scheduled]
            if not applied:  # a sequence swapped out this step may not have reached the host pool
                hit += [seq for seq in sched.preempted if seq.status is SequenceStatus.SWAPPED]
            for rid in dict.fromkeys(seq.request_id for seq in hit):
                self._fail(self.requests[rid], "forward" if applied else "block copies", e)
            return None

    def _append_tokens(self, result: ExecuteResult) -> dict[str, RequestState]:
        """Verify or fork, sample, append each sampled sequence's tokens; a raise fails that request
        only. Returns the requests touched."""
        logits, hidden, spec = result.logits, result.hidden, self.speculative
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        rows, targets, row = [], [], 0
        for seq, nrows in result.groups:
            req = self.requests.get(seq.request_id)
            if req is None:  # aborted while its batch was in flight (pipelined steps)
                row += nrows
                continue
            touched[seq.request_id] = req
            try:  # (a finished sequence's request failed with another of its samples)
                if seq.spec_token_ids and not seq.is_finished:
                    computed = seq.num_computed_tokens
                    spec.verify(
                        seq,
                        logits[row : row + nrows],
                        None if hidden is None else hidden[row : row + nrows],
                        functools.partial(self._append, req, seq, now=now),
                    )
                    if self.block_manager.states is not None and not seq.is_finished:  # hybrid: the mixers'
                        # state rolls back to the last accepted token
                        self.runner.keep_state(seq.seq_id, seq.num_computed_tokens - computed)
                elif not seq.is_finished:
                    group = [seq]
                    if seq.num_output_tokens == 0 and seq.index == 0 and req.params.n > 1 and len(req.seqs) == 1:
                        group += self.output.fork(req, seq, self._seq_ids, self._place)
                    if hidden is not None:
                        spec.observe(group, hidden[row])
                    rows += [row] * len(group)
                    targets += group
            except Exception as e:
                self._fail(req, "postprocess", e)
            row += nrows
        row_of = {s.seq_id: r for s, r in zip(targets, rows)}

        def sample_rows(batch: list[Sequence]) -> list[SampleResult]:
            index = [row_of[s.seq_id] for s in batch]  # usually every row in order: then no gather
            same = len(index) == logits.shape[0] and index == list(range(len(index)))
            return sample(logits if same else logits[index], batch)

        for seq, res in per_sequence("sample", targets, sample_rows, self.fault_injector, self._fail_seq):
            if not seq.is_finished:
                try:
                    self._append(self.requests[seq.request_id], seq, res, now)
                except Exception as e:
                    self._fail(self.requests[seq.request_id], "postprocess", e)
        return touched

    def _outputs(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """One output per request touched or failed this step; finished requests leave the engine."""
        outputs = []
        for req in touched.values():
            if req.error is None:
                final = all(s.is_finished for s in req.seqs)
                if req.final_only and not final:
                    continue
                try:
                    outputs.append(req.output(final=final))
                except Exception as e:
                    self._fail(req, "output", e)
        if self._failed:
            outputs += [req.output(final=True) for req in self._failed]
            self._failed.clear()
            s = self.scheduler
            live = s.running + s.waiting + s.swapped
            problem = self.block_manager.problem(live)
            if problem is not None:
                raise EngineFault(f"the KV cache does not add up after failing requests: {problem}")
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    # ------------------------------------------------------------------------------ failures
    def _fail(self, req: RequestState, phase: str, exc: Exception) -> None:
        """Fail one request: retire its sequences (their blocks are free at once); step() reports it."""
        if req.error is not None:
            return
        log.error(
            "request %s failed in %s; the engine goes on without it: %r", req.request_id, phase, exc, exc_info=exc
        )
        req.error = f"{phase} failed: {exc!r}"
        try:
            for seq in req.seqs:
                self._retire(seq, "error")
        except Exception as e:
            raise EngineFault(f"could not release request {req.request_id!r} after its {phase} failure: {e!r}") from e
        self._failed.append(req)

    def _fail_seq(self, seq: Sequence, phase: str, exc: Exception) -> None:
        self._fail(self.requests[seq.request_id], phase, exc)

    def _fail_unschedulable(self) -> None:
        """Admission makes this unreachable; should the pool still not take the head of the queue,
        that request fails, not the engine."""
        s = self.scheduler
        seq = (s.swapped or s.waiting or s.running)[0]
        self._fail(
            self.requests[seq.request_id],
            "scheduling",
            RuntimeError(
                f"the scheduler made no progress: the KV cache ({self.block_manager.num_blocks} blocks, "
                f"{self.block_manager.num_free_blocks} free) cannot hold this request's next step"
            ),
        )
