"""AsyncLLMEngine: the engine loop on a background thread, per-request async output streams.

The gRPC server awaits `generate(...)`; leaving the iterator early (client cancelled, deadline)
aborts the request, which frees its KV blocks at once. Requests are validated in the caller's
thread, so bad input raises ValueError before anything is queued. A request the engine fails
(its final output carries `error`) raises RequestFailedError in its stream only; the loop stops
only when step() itself raises, and then every stream gets EngineDeadError with the reason and
`on_dead(reason)` is called on the engine thread (the server turns its health NOT_SERVING at
once, with or without a call in flight).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable

from baton.serve.core.faults import EngineFault
from baton.serve.engine import LLMEngine
from baton.serve.outputs import RequestOutput
from baton.serve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop crashed; in-flight and new requests fail with this."""

    def __init__(self, reason: str):
        super().__init__(f"engine loop crashed: {reason}")
        self.reason = reason


class RequestFailedError(RuntimeError):
    """The engine failed this one request (a server-side bug); it and the other requests go on."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id!r} failed in the engine: {message}")
        self.request_id, self.message = request_id, message


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05):
        self.engine = engine
        self._lock = threading.Lock()  # every engine call happens under it
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.dead: BaseException | None = None
        self.failure_reason: str | None = None  # set with dead: a short why
        self.on_dead: Callable[[str], object] | None = None  # called with failure_reason, on the engine thread
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while not self._stopping:
            try:
                with self._lock:
                    busy = self.engine.has_unfinished_requests()
                    outputs = self.engine.step() if busy else []
                    if not busy:  # idle: a sharded model's lost worker must still be noticed
                        self.engine.check_health()
            except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
                self.failure_reason = str(e) if isinstance(e, EngineFault) else repr(e)
                log.exception("engine loop crashed: %s", self.failure_reason)
                self.dead = e
                for rid in list(self._streams):
                    self._deliver(rid, EngineDeadError(self.failure_reason))
                self._report_death()
                return
            for out in outputs:
                failed = out.error is not None
                self._deliver(out.request_id, RequestFailedError(out.request_id, out.error) if failed else out)
            if not busy:
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()

    def _report_death(self) -> None:
        on_dead = self.on_dead
        if on_dead is not None:
            try:
                on_dead(self.failure_reason)
            except Exception:  # e.g. the server's event loop is already closed
                log.warning("on_dead(%r) raised", self.failure_reason, exc_info=True)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop is gone
                pass

    # ------------------------------------------------------------------------------ callers
    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        if self.dead is not None:
            raise EngineDeadError(self.failure_reason)
        if self._stopping:
            raise RuntimeError("engine is shutting down")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add() -> None:  # in a worker thread: waiting for the lock must not block the event loop
            with self._lock:
                self.engine.add_request(request_id, prompt, params, priority=priority)  # ValueError on bad input
                self._streams[request_id] = (loop, queue)

        await asyncio.to_thread(add)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)

    def snapshot(self, fn):
        """Run fn(engine) under the lock (consistent stats for metrics/ServerInfo)."""
        with self._lock:
            return fn(self.engine)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine thread, then what the engine started (a sharded model's workers)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self.engine.shutdown()
