"""CoERuntime: several experts, each a whole model with its own engine, behind one server.

Each expert is a plain Runtime (its own engine, admission and KV share) sharing the server's
metrics; this runtime answers for the server (health, limits, the CoE name) and picks the
expert per request: a name picks that expert, the CoE's name (or none) asks the router, whose
choice stands at or above the threshold and otherwise goes to the fallback expert. Experts load
and unload one at a time (KServe's repository API) without touching the others' engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field

import grpc
import torch
from baton.common.config import ConfigError
from baton.common.router import Router, load_router
from baton.serve.async_engine import AsyncLLMEngine
from baton.serve.coe.config import MB, CoEConfig, ExpertSpec, check_expert
from baton.serve.coe.metrics import CoEMetrics
from baton.serve.core.stats import EngineStats
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.quantization.loader import quantization_config
from baton.serve.rpc import RpcError, invalid
from baton.serve.runtime import Call, Limits, Runtime

log = logging.getLogger(__name__)


@dataclass
class Expert:
    spec: ExpertSpec
    state: str = "UNAVAILABLE"  # READY, LOADING, UNLOADING, UNAVAILABLE (KServe's repository states)
    reason: str = "not loaded"
    rt: Runtime | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"named": 0, "routed": 0, "fallback": 0})


class _Totals:
    """The server's admission view (drain waits on it): the sums over the experts'."""

    def __init__(self, experts: dict[str, Expert]):
        self._experts = experts

    def _sum(self, attr: str) -> int:
        return sum(getattr(e.rt.admission, attr) for e in self._experts.values() if e.rt is not None)

    running = property(lambda self: self._sum("running"))
    queued = property(lambda self: self._sum("queued"))
    active = property(lambda self: self._sum("active"))


def aggregate(stats: list[EngineStats]) -> EngineStats:
    """One EngineStats for the whole CoE: counts summed, rates recomputed from the sums."""
    total = {
        f.name: sum(getattr(s, f.name) for s in stats)
        for f in dataclasses.fields(EngineStats)
        if f.type in ("int", int)
    }
    prompt = total["prompt_tokens"]
    hit = sum(s.prefix_cache_hit_rate * s.prompt_tokens for s in stats) / prompt if prompt else 0.0
    proposed, accepted = total["spec_proposed_tokens"], total["spec_accepted_tokens"]
    return EngineStats(
        **total,
        prefix_cache_hit_rate=hit,
        spec_acceptance_rate=accepted / proposed if proposed else 0.0,
        spec_mean_accepted_length=0.0,  # per expert only: passes differ in depth between experts
        spec_method=stats[0].spec_method if stats else "none",  # one EngineConfig serves every expert
    )


class CoERuntime(Runtime):
    def __init__(
        self,
        cfg: CoEConfig,
        limits: Limits,
        engine: EngineConfig,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        drain_timeout_s: float = 30.0,
    ):
        super().__init__(cfg.name, limits)
        self.cfg, self.engine_config, self.device, self.dtype = cfg, engine, device, dtype
        self.drain_timeout_s = drain_timeout_s
        self.experts = {spec.name: Expert(spec) for spec in cfg.experts}
        self.admission = _Totals(self.experts)
        self.router: Router | None = None
        self._router_lock = threading.Lock()  # one router forward at a time (it runs off the event loop)
        self._changing = asyncio.Lock()  # one load or unload at a time: budget checks see settled shares
        self.coe_metrics = CoEMetrics(self.metrics.registry, self._loads)
        self.route_decisions, self._confidence_sum, self._route_s = 0, 0.0, 0.0

    # ------------------------------------------------------------------------------ choosing
    def check_model(self, name: str, version: str = "") -> None:
        """An expert's name, the CoE's (or empty), and version 1 or none."""
        if name and name != self.model_name and name not in self.experts:
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {name!r}; this server serves {self.model_name!r} (routed) and "
                f"{', '.join(map(repr, self.experts))}",
            )
        if version not in ("", "1"):
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"model {name or self.model_name!r} has only version '1'")

    def _ready(self, name: str) -> Runtime:
        e = self.experts[name]
        if e.state != "READY" or e.rt is None or e.rt.state != "serving":
            why = e.reason if e.state == "UNAVAILABLE" else e.state.lower()
            if e.rt is not None and e.rt.state == "failed":
                why = f"its engine failed: {e.rt.failure_reason}; unload and load it again"
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"expert {name!r} is not ready ({why})")
        return e.rt

    def resolve(self, name: str, version: str = "") -> Runtime:
        """A named expert; the CoE's name in a non-generation call means the fallback expert."""
        self.check_model(name, version)
        return self._ready(name if name in self.experts else self.cfg.fallback)

    async def route(self, call: Call, name: str, prompt: str | list[int], version: str = "") -> Runtime:
        self.check_model(name, version)
        if name in self.experts:
            chosen, how = name, "named"
        elif self.router is None:
            chosen, how = self.cfg.fallback, "fallback"
        else:
            if not isinstance(prompt, str):
                raise invalid(f"token_ids need an expert's name ({', '.join(self.experts)}): the router reads text")
            chosen, how = await asyncio.to_thread(self._decide, prompt)
        rt = self._ready(chosen)
        self.experts[chosen].counts[how] += 1
        self.coe_metrics.requests.labels(chosen, how).inc()
        call.model = chosen
        return rt

    def _decide(self, prompt: str) -> tuple[str, str]:
        """(expert, how) from the router: its choice if confident and ready, else the fallback."""
        t0 = time.perf_counter()
        with self._router_lock:
            expert, confidence = self.router.route([prompt])[0]
            elapsed = time.perf_counter() - t0
            self.route_decisions += 1
            self._confidence_sum += confidence
            self._route_s += elapsed
        self.coe_metrics.observe_route(expert, confidence, elapsed)
        ready = self.experts[expert].state == "READY"
        if confidence >= self.cfg.router.threshold and ready:
            return expert, "routed"
        return self.cfg.fallback, "fallback"

    # ------------------------------------------------------------------------------ loading
    async def load_all(self) -> None:
        """Start-up: the router, then every expert (one failing ends start-up with its error)."""
        if self.cfg.router is not None:
            spec = self.cfg.router
            self.router = await asyncio.to_thread(load_router, spec.path, self.device, spec.base)
            log.info("router %s (%s) loaded, threshold %.2f", spec.path, self.router.config.kind, spec.threshold)
        for name in self.experts:
            await self._load(name)
        await self.set_state("serving")

    async def _load(self, name: str) -> None:
        e = self.experts[name]
        e.state, e.reason = "LOADING", ""
        t0 = time.monotonic()
        config = dataclasses.replace(self.engine_config, kv_cache_bytes=e.spec.kv_cache_bytes, num_kv_blocks=None)
        try:
            core = await asyncio.to_thread(
                LLMEngine.from_checkpoint, e.spec.checkpoint, config, self.device, self.dtype
            )
        except Exception as exc:
            e.state, e.reason = "UNAVAILABLE", f"failed to load: {exc}"
            raise
        rt = Runtime(name, self.limits, self.metrics)
        q = quantization_config(e.spec.checkpoint)
        rt.quantization = "none" if q is None else f"{q.get('method')} {q.get('format')}"
        await rt.attach(AsyncLLMEngine(core))
        e.rt, e.state = rt, "READY"
        log.info(
            "expert %s loaded from %s in %.1f s (%d KV blocks, %.1f MB)",
            name,
            e.spec.checkpoint,
            time.monotonic() - t0,
            core.block_manager.num_blocks,
            e.spec.kv_cache_bytes / MB,
        )

    def _free_bytes(self, besides: str) -> int:
        held = sum(e.spec.kv_cache_bytes for n, e in self.experts.items() if n != besides and e.state != "UNAVAILABLE")
        return self.cfg.kv_cache_bytes - held

    async def load_model(self, name: str, config_json: str | None) -> None:
        """Load a known expert again, or add one: config {"checkpoint": ..., "kv_cache_mb": ...}."""
        async with self._changing:
            added = self._new_expert(name, config_json) if config_json is not None else None
            if added is None and name not in self.experts:
                raise RpcError(
                    grpc.StatusCode.NOT_FOUND,
                    f"no expert {name!r} in {self.cfg.source}; to add one pass a config parameter "
                    '{"checkpoint": DIR, "kv_cache_mb": MB}',
                )
            e = added or self.experts[name]
            if e.state == "READY":
                return
            free = self._free_bytes(name)
            if e.spec.kv_cache_bytes > free:
                raise RpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"expert {name!r} needs {e.spec.kv_cache_bytes / MB:g} MB of KV cache; "
                    f"{free / MB:g} MB of the {self.cfg.kv_cache_bytes / MB:g} MB budget is free",
                )
            self.experts[name] = e
            try:
                await self._load(name)
            except Exception as exc:  # noqa: BLE001 - a bad checkpoint fails this call, not the server
                raise RpcError(grpc.StatusCode.INTERNAL, f"expert {name!r} failed to load: {exc}") from None

    def _new_expert(self, name: str, config_json: str) -> Expert:
        if name in self.experts and self.experts[name].state != "UNAVAILABLE":
            raise invalid(f"expert {name!r} is loaded: unload it before loading it with a new config")
        try:
            raw = json.loads(config_json)
            spec = ExpertSpec(name=name, **raw)
            check_expert(spec, set(self.experts) - {name}, self.model_name)
        except (json.JSONDecodeError, TypeError) as exc:
            raise invalid(f'config must be JSON {{"checkpoint": DIR, "kv_cache_mb": MB}}: {exc}') from None
        except ConfigError as exc:
            raise invalid(str(exc)) from None
        if spec.kv_cache_mb is None:
            raise invalid(f"expert {name!r}: config needs kv_cache_mb (its share of the KV budget)")
        spec.kv_cache_bytes = int(spec.kv_cache_mb * MB)
        return Expert(spec)

    async def unload_model(self, name: str) -> None:
        """New requests for it are refused at once; its in-flight ones finish (up to the drain
        timeout, then they are cancelled); then its engine stops. The other experts run on."""
        async with self._changing:
            if name not in self.experts:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"no expert {name!r}")
            e = self.experts[name]
            if e.state != "READY":
                return
            e.state = "UNLOADING"
            rt = e.rt
            deadline = time.monotonic() + self.drain_timeout_s
            while rt.admission.active and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.to_thread(rt.async_engine.shutdown)
            e.rt, e.state, e.reason = None, "UNAVAILABLE", "unloaded"
            log.info("expert %s unloaded", name)

    async def shutdown_all(self) -> None:
        for e in self.experts.values():
            if e.rt is not None:
                await asyncio.to_thread(e.rt.async_engine.shutdown)
                e.rt, e.state, e.reason = None, "UNAVAILABLE", "server stopped"

    # ------------------------------------------------------------------------------ state
    async def set_state(self, state: str, reason: str | None = None) -> None:
        """One expert's engine dying fails that expert (its runtime says so), not the whole CoE."""
        if state == "failed" and any(e.rt is not None and e.rt.state == "serving" for e in self.experts.values()):
            log.error("an expert's engine failed; the other experts go on serving: %s", reason)
            return
        await super().set_state(state, reason)

    def engine_stats(self) -> EngineStats | None:
        stats = [s for s in (self._stats(e) for e in self.experts.values()) if s is not None]
        if not stats:
            return None
        total = aggregate(stats)
        return dataclasses.replace(total, active_calls=self.admission.running, queued_calls=self.admission.queued)

    @staticmethod
    def _stats(e: Expert) -> EngineStats | None:
        rt = e.rt
        return None if rt is None or rt.async_engine is None else rt.engine_stats()

    def _loads(self) -> list[tuple[str, bool, EngineStats | None]]:
        return [(n, e.state == "READY", self._stats(e)) for n, e in self.experts.items()]

    def repository_index(self) -> list[tuple[str, str, str]]:
        return [(n, e.state, "" if e.state == "READY" else e.reason) for n, e in self.experts.items()]

    def composition_info(self) -> dict:
        experts = []
        for name, e in self.experts.items():
            s = self._stats(e)
            experts.append(
                dict(
                    name=name,
                    state=e.state,
                    checkpoint=str(e.spec.checkpoint),
                    kv_cache_bytes=e.spec.kv_cache_bytes,
                    active_calls=s.active_calls if s else 0,
                    queued_calls=s.queued_calls if s else 0,
                    running_seqs=s.running_seqs if s else 0,
                    kv_blocks_total=s.kv_blocks_total if s else 0,
                    kv_blocks_free=s.kv_blocks_free if s else 0,
                    named_requests=e.counts["named"],
                    routed_requests=e.counts["routed"],
                    fallback_requests=e.counts["fallback"],
                    generation_tokens=s.generation_tokens if s else 0,
                    fallback=name == self.cfg.fallback,
                    reason="" if e.state == "READY" else e.reason,
                )
            )
        n = self.route_decisions
        return dict(
            name=self.model_name,
            router_kind=self.router.config.kind if self.router else "",
            threshold=self.cfg.router.threshold if self.cfg.router else 0.0,
            route_decisions=n,
            mean_confidence=self._confidence_sum / n if n else 0.0,
            mean_route_ms=self._route_s / n * 1e3 if n else 0.0,
            experts=experts,
        )
