"""Admission control: at most `max_running` generation calls in the engine, `max_queued` waiting.

The engine would accept any number of requests and let its waiting list grow without bound; a
server must instead say "full" early (RESOURCE_EXHAUSTED) so clients back off or go elsewhere.
Calls wait in arrival order; a waiting call that is cancelled or hits its deadline just leaves.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import grpc

from baton.serve.rpc import RpcError


class Admission:
    def __init__(self, max_running: int, max_queued: int):
        if max_running < 1 or max_queued < 0:
            raise ValueError("max concurrent requests must be >= 1 and max queued requests >= 0")
        self.max_running, self.max_queued = max_running, max_queued
        self.running = 0
        self.queued = 0
        self._waiters: asyncio.Queue[asyncio.Future] | None = None

    @property
    def active(self) -> int:
        return self.running + self.queued

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.running >= self.max_running:
            if self.queued >= self.max_queued:
                raise RpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"server is full: {self.running} requests running and {self.queued} queued "
                    "(raise --max-concurrent/--max-queued or retry later)",
                )
            await self._wait_turn()
        else:
            self.running += 1
        try:
            yield
        finally:
            self._release()

    async def _wait_turn(self) -> None:
        if self._waiters is None:
            self._waiters = asyncio.Queue()
        turn = asyncio.get_running_loop().create_future()
        self._waiters.put_nowait(turn)
        self.queued += 1
        try:
            await turn  # _release hands its slot over: `running` is already counted for us
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # the slot arrived as we were cancelled: pass it on
            raise
        finally:
            self.queued -= 1

    def _release(self) -> None:
        while self._waiters is not None and not self._waiters.empty():
            turn = self._waiters.get_nowait()
            if not turn.done():
                turn.set_result(None)  # hand the slot over without freeing it
                return
        self.running -= 1
