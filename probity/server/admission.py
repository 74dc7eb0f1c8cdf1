"""Bounded admission: up to `capacity` requests in the engine, then a bounded FIFO queue."""
from __future__ import annotations

import asyncio
import time
from collections import deque

from .errors import APIError


class Admission:
    def __init__(self, capacity: int, max_queue: int, timeout: float):
        self.capacity = capacity
        self.max_queue = max_queue
        self.timeout = timeout
        self.active = 0
        self.waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self.waiters)

    async def acquire(self) -> float:
        """Take a slot; returns seconds waited. Raises 429 queue_full / queue_timeout."""
        if self.active < self.capacity and not self.waiters:
            self.active += 1
            return 0.0
        if len(self.waiters) >= self.max_queue:
            raise APIError("queue_full", f"the queue is full ({self.max_queue} waiting)",
                           headers={"Retry-After": "1"})
        t0 = time.monotonic()
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we gave up: pass it on
            else:
                fut.cancel()
            self._forget(fut)
            raise APIError("queue_timeout", f"waited {self.timeout:g}s in the queue without a slot",
                           headers={"Retry-After": "1"}) from None
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                fut.cancel()
            self._forget(fut)
            raise
        return time.monotonic() - t0

    def _forget(self, fut: asyncio.Future) -> None:
        try:
            self.waiters.remove(fut)
        except ValueError:
            pass

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to the next waiter
                return
        self.active -= 1
