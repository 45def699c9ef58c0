"""What the gateway does when a vocoder replica loses a stream's session, and cleanup that must
outlive the stream that started it.

A stream's vocoder session holds audio state (f0 phase, mel tail) built from every chunk so far.
When the session is lost (the replica died or restarted: UNAVAILABLE / CANCELLED; it evicted
the session: NOT_FOUND; or it ended the call early and grpc.aio reported only `Internal error
from Core`), the gateway still has every mel chunk of the stream (they are kept until the stream
ends: at most 300 s = 4.8 MB). It opens a new session on another replica (the same one when no
other is known, e.g. after a restart), replays the chunks from seq 0, and drops the audio of the
chunks it already delivered: replay rebuilds the same state, so the client gets every sample
once, equal to a run without the fault up to the vocoder's float rounding.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine

import grpc

from gateway import metrics

logger = logging.getLogger(__name__)

CORE_WRITE_ERROR = "Internal error from Core"  # grpc.aio: a write failed on a finished call

_LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND}


class SessionLost(Exception):
    """The vocoder session of a stream is gone; `reason` says how (for the log and metric)."""

    def __init__(self, addr: str, reason: str, error: Exception):
        super().__init__(f"vocoder {addr}: {reason}")
        self.addr = addr
        self.reason = reason
        self.error = error  # what the client gets when no failover is left


def lost_reason(exc: grpc.aio.AioRpcError) -> str | None:
    """Why a Session call's error means the session is lost, or None when it is not."""
    code = exc.code()
    if code in _LOST:
        return code.name
    if code == grpc.StatusCode.INTERNAL and exc.details() == CORE_WRITE_ERROR:
        return "ENDED_EARLY"
    return None


_background: set[asyncio.Task] = set()  # strong references until each task ends


def detach(coro: Coroutine, name: str) -> asyncio.Task:
    """Run `coro` in a task no stream owns: cancelling the stream (its client left) does not
    cancel it. For cleanup such as CancelSession, which must not die with the stream."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _background.add(task)
    task.add_done_callback(_finished)
    return task


def _finished(task: asyncio.Task) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("%s failed: %s", task.get_name(), task.exception())


def count_failover(reason: str) -> None:
    metrics.VOCODER_FAILOVERS.labels(reason).inc()


class RetryBudget:
    """Retries allowed across all streams: `ratio` of the calls made plus `min_per_s`, saved up
    to `cap`. When a stage is down, calls then fail after one attempt instead of multiplying
    the load on the replicas left (a retry storm) by the number of attempts."""

    def __init__(self, ratio: float = 0.2, min_per_s: float = 10.0, cap: float = 100.0):
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.cap = cap
        self._tokens = cap
        self._at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.cap, self._tokens + (now - self._at) * self.min_per_s)
        self._at = now

    def on_call(self) -> None:
        self._refill()
        self._tokens = min(self.cap, self._tokens + self.ratio)

    def try_retry(self) -> bool:
        self._refill()
        if self._tokens < 1.0:
            metrics.RETRIES.labels("budget_exhausted").inc()
            return False
        self._tokens -= 1.0
        metrics.RETRIES.labels("retried").inc()
        return True
