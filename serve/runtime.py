"""What every service shares: the engine, the server's state, limits, and per-request accounting.

All generation goes through `Runtime.generate`, whichever protocol the request came in on, so
limits, admission, metrics and the one log line per request are the same for all of them.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
import os
import time
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import AsyncIterator

import grpc
from baton.serve import proto
from baton.serve.admission import Admission
from baton.serve.async_engine import AsyncLLMEngine, EngineDeadError
from baton.serve.core.stats import EngineStats
from baton.serve.engine import LLMEngine
from baton.serve.metrics import ServerMetrics
from baton.serve.outputs import RequestOutput
from baton.serve.rpc import RpcError, invalid, status_of
from baton.serve.sampling_params import SamplingParams
from grpc_health.v1 import health, health_pb2

log = logging.getLogger("baton.serve.requests")

try:
    VERSION = version("baton")
except PackageNotFoundError:  # running from a tree that was never installed
    VERSION = "0+unknown"


@dataclass
class Limits:
    max_concurrent: int = 64  # generation calls in the engine at once
    max_queued: int = 256  # calls waiting for one of those slots; beyond: RESOURCE_EXHAUSTED
    max_prompt_tokens: int | None = None  # None: the model's context
    max_output_tokens: int = 1024  # per sample (sampling max_tokens)
    max_message_bytes: int = 4 * 2**20  # largest request or response message
    # Per-request bounds on what the wire lets a client ask for (sampling n, stop lists): without
    # them one call could hold the engine for everyone (n forks bypass max_num_seqs admission, and
    # every stop string is searched in every new piece of text).
    max_n: int = 16  # parallel samples per request (vLLM: VLLM_MAX_N_SEQUENCES; OpenAI's n caps at 128)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256  # per stop string
    max_stop_token_ids: int = 64

    def validate(self) -> None:
        """A limit that admits nothing would refuse (or, for max_concurrent, stall) every call."""
        at_least_one = ("max_concurrent", "max_output_tokens", "max_message_bytes", "max_n", "max_stop_string_chars")
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queued", "max_stop_strings", "max_stop_token_ids"):  # 0: none allowed
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1 (or unset), got {self.max_prompt_tokens}")


@dataclass
class Call:
    """One generation request's accounting, for its log line and the metrics."""

    api: str
    request_id: str
    peer: str
    start: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    model: str = ""  # the model that generated, when not the server's name (a CoE's expert)


@dataclass
class Ledger:
    """One front-end request's accounting, for fronts that run code outside Runtime.request (HTTP:
    the gate sets one per request): the log lines its generations wrote, and the error a handler
    turned into a response. A request that wrote none gets its one line from the front."""

    logged: int = 0
    error: BaseException | None = None


LEDGER: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar("baton_request_ledger", default=None)


def note_error(e: BaseException) -> None:
    """Remember the error the current request answers with (its log line names the type)."""
    ledger = LEDGER.get()
    if ledger is not None and ledger.error is None:
        ledger.error = e


def _ms(t: float | None, since: float) -> str:
    return "-" if t is None else f"{(t - since) * 1e3:.1f}"


class Runtime:
    def __init__(self, model_name: str, limits: Limits, metrics: ServerMetrics | None = None):
        self.model_name = model_name
        self.limits = limits
        self.state = "loading"  # -> "serving" -> "draining", or "failed" if the engine loop dies
        self.failure_reason: str | None = None  # why the engine died (refusals and ServerInfo say it)
        self.health = health.aio.HealthServicer()
        self.async_engine: AsyncLLMEngine | None = None  # set by attach(), once the model is loaded
        self.quantization = "none"  # e.g. "gptq int4", from the checkpoint's quantization_config
        self.admission = Admission(limits.max_concurrent, limits.max_queued)
        self.metrics = metrics or ServerMetrics(self.engine_stats)  # a CoE's experts share the server's
        self.started = time.monotonic()
        self._ids = itertools.count()
        self._id_prefix = f"{os.getpid():x}"
        self._failing: asyncio.Future | None = None  # set_state("failed") scheduled by the engine thread

    # ------------------------------------------------------------------------------ checks
    def check_model(self, name: str, version: str = "") -> None:
        """Empty name means the served model; anything else must match it."""
        if name and name != self.model_name:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"unknown model {name!r}; this server serves {self.model_name!r}")
        if version not in ("", "1"):
            raise RpcError(
                grpc.StatusCode.NOT_FOUND, f"model {self.model_name!r} has no version {version!r} (only '1')"
            )

    def resolve(self, name: str, version: str = "") -> Runtime:
        """The runtime serving `name` in a non-generation call: here, this one (serve/coe/ has several)."""
        self.check_model(name, version)
        return self

    async def route(self, call: Call, name: str, prompt: str | list[int], version: str = "") -> Runtime:
        """The runtime that generates for this request (a CoE's router may choose by the prompt)."""
        return self.resolve(name, version)

    def repository_index(self) -> list[tuple[str, str, str]]:
        """KServe's repository index: (name, state, reason) per model."""
        return [(self.model_name, "READY" if self.state == "serving" else "UNAVAILABLE", self.failure_reason or "")]

    async def load_model(self, name: str, config_json: str | None) -> None:
        raise RpcError(grpc.StatusCode.UNIMPLEMENTED, "loading models needs a Composition of Experts (--coe)")

    async def unload_model(self, name: str) -> None:
        raise RpcError(grpc.StatusCode.UNIMPLEMENTED, "unloading models needs a Composition of Experts (--coe)")

    def composition_info(self) -> dict | None:
        """ServerInfo's `coe` message fields, when serving a Composition of Experts."""
        return None

    @property
    def core(self) -> LLMEngine:
        """The engine behind the async one (its tokenizer, config, validation)."""
        if self.async_engine is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.async_engine.engine

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Prompt token ids after every check, or RpcError naming what is wrong."""
        lim = self.limits
        if params.max_tokens > lim.max_output_tokens:
            raise invalid(
                f"max_tokens is {params.max_tokens}; this server allows at most "
                f"{lim.max_output_tokens} (--max-output-tokens)"
            )
        if params.n > lim.max_n:
            raise invalid(f"n is {params.n}; this server allows at most {lim.max_n} (--max-n)")
        if len(params.stop) > lim.max_stop_strings:
            raise invalid(
                f"stop has {len(params.stop)} strings; this server allows at most "
                f"{lim.max_stop_strings} (--max-stop-strings)"
            )
        longest = max(map(len, params.stop), default=0)
        if longest > lim.max_stop_string_chars:
            raise invalid(
                f"a stop string has {longest} characters; this server allows at most "
                f"{lim.max_stop_string_chars} (--max-stop-chars)"
            )
        if len(params.stop_token_ids) > lim.max_stop_token_ids:
            raise invalid(
                f"stop_token_ids has {len(params.stop_token_ids)} ids; this server allows at most "
                f"{lim.max_stop_token_ids} (--max-stop-token-ids)"
            )
        ids = self.core.validate_request(prompt, params)  # ValueError -> INVALID_ARGUMENT
        if lim.max_prompt_tokens is not None and len(ids) > lim.max_prompt_tokens:
            raise invalid(
                f"prompt has {len(ids)} tokens; this server allows at most "
                f"{lim.max_prompt_tokens} (--max-prompt-tokens)"
            )
        return ids

    # ------------------------------------------------------------------------------ generation
    @asynccontextmanager
    async def request(self, api: str, context: grpc.aio.ServicerContext) -> AsyncIterator[Call]:
        """Accounts for one generation request, parsing included: metrics and one log line."""
        call = Call(api, f"{self._id_prefix}-{next(self._ids)}", context.peer())
        outcome = "ok"
        try:
            yield call
        except (asyncio.CancelledError, GeneratorExit):
            remaining = context.time_remaining()
            outcome = "deadline_exceeded" if remaining is not None and remaining < 0.05 else "cancelled"
            raise
        except EngineDeadError as e:
            outcome = "internal"
            await self.set_state("failed", e.reason)  # refuse new work, fail health: the process must be restarted
            raise
        except Exception as e:
            outcome = status_of(e)[0].name.lower()
            raise
        finally:
            self._finish(call, outcome)

    async def generate(
        self, call: Call, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Check, wait for admission, then stream the engine's outputs (closing early aborts)."""
        ids = await asyncio.to_thread(self.prepare, prompt, params)  # a huge prompt must not stall the loop
        call.prompt_tokens = len(ids)
        async with self.admission.slot():
            call.admitted = time.monotonic()
            async with aclosing(self.async_engine.generate(ids, params, call.request_id, priority)) as stream:
                async for out in stream:
                    self._observe(call, out)
                    yield out

    def _observe(self, call: Call, out: RequestOutput) -> None:
        now = time.monotonic()
        if any(c.delta_token_ids for c in out.outputs):
            if call.first_token is None:
                call.first_token = now
                self.metrics.ttft.observe(now - call.start)
            else:
                self.metrics.itl.observe(now - call.last_token)
            call.last_token = now
        m = out.metrics
        call.cached_tokens, call.output_tokens = m.num_cached_prompt_tokens, m.num_generated_tokens

    def _finish(self, call: Call, outcome: str) -> None:
        if (ledger := LEDGER.get()) is not None:
            ledger.logged += 1
        self.metrics.requests.labels(call.api, outcome).inc()
        log.info(
            "request id=%s api=%s model=%s outcome=%s prompt_tokens=%d cached_tokens=%d output_tokens=%d "
            "queue_ms=%s ttft_ms=%s total_ms=%.1f peer=%s",
            call.request_id,
            call.api,
            call.model or self.model_name,
            outcome,
            call.prompt_tokens,
            call.cached_tokens,
            call.output_tokens,
            _ms(call.admitted, call.start),
            _ms(call.first_token, call.start),
            (time.monotonic() - call.start) * 1e3,
            call.peer,
        )

    def reject(self, api: str, code: grpc.StatusCode | str, peer: str, why: str, error: str | None = None) -> None:
        """Account for a call that ended before any generation: refused at the door (auth, loading,
        draining), or failed in the front (a bad body, an internal error: `error` names its type)."""
        outcome = code if isinstance(code, str) else code.name.lower()
        self.metrics.requests.labels(api, outcome).inc()
        log.info(
            "request id=- api=%s model=%s outcome=%s peer=%s reason=%r%s",
            api,
            self.model_name,
            outcome,
            peer,
            why,
            f" error={error}" if error else "",
        )

    # ------------------------------------------------------------------------------ state
    async def attach(self, engine: AsyncLLMEngine) -> None:
        """Serve with this engine. Should its loop die, health turns NOT_SERVING at once, whether
        or not a call is in flight (on_dead is called on the engine thread). What a request would
        otherwise build first (the structured-output compiler) is built before the state turns serving."""
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(engine.engine.grammars.prepare)
        self.async_engine = engine
        await self.set_state("serving")
        engine.on_dead = lambda reason: loop.call_soon_threadsafe(self._engine_died, reason)
        if engine.dead is not None:  # it died before on_dead was set
            await self.set_state("failed", engine.failure_reason)

    def _engine_died(self, reason: str) -> None:
        """On the event loop, from on_dead: fail health now (the task is kept referenced until done)."""
        self._failing = asyncio.ensure_future(self.set_state("failed", reason))

    async def set_state(self, state: str, reason: str | None = None) -> None:
        """Health follows the state: SERVING only while serving. The first failure's reason is kept."""
        if state == "failed" and self.failure_reason is None:
            self.failure_reason = reason or "unknown"
            log.error("the engine failed, refusing new work until restarted: %s", self.failure_reason)
        self.state = state
        if state == "draining":
            await self.health.enter_graceful_shutdown()  # NOT_SERVING for good
        else:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if state == "serving"
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", proto.BATON_SERVICE, proto.KSERVE_SERVICE):
                await self.health.set(name, status)

    def engine_stats(self) -> EngineStats | None:
        """The engine's numbers, read under its lock, with the admission counts (None while loading)."""
        if self.async_engine is None:
            return None
        stats = self.async_engine.snapshot(LLMEngine.stats)
        return dataclasses.replace(stats, active_calls=self.admission.running, queued_calls=self.admission.queued)
