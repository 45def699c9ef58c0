"""The client's side of a Synthesize stream, read by one task that the servicer owns.

Why a task of its own: a refusal must reach the client with the server's code. grpc.aio's
client replaces the status with `INTERNAL: Internal error from Core` when the server ends the
call while one of the client's writes is in flight (grpc/grpc#36066). So before a stream ends
with an error, the gateway keeps reading (and discarding) the client's messages until the client
half-closes, for a bounded time (`drain`). The pipeline's reader task may be cancelled at any
point; this one outlives it, so the request iterator is never abandoned half-read.

It also enforces the per-stream idle limits: a client that sent its config and then nothing, or
some tokens and then neither more tokens nor EndOfInput, is ended with DEADLINE_EXCEEDED instead
of holding a stream slot forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from token2wav.errors import DeadlineExceeded

_EOF = object()  # the client half-closed


@dataclass(frozen=True)
class InboundLimits:
    first_message_timeout: float = 30.0  # s from the call's start to its StreamConfig
    first_tokens_timeout: float = 30.0  # s from the StreamConfig to the first tokens
    idle_timeout: float = 120.0  # s between messages once tokens flow, until EndOfInput
    drain_timeout: float = 2.0  # s a failing stream keeps reading for the client's half-close
    max_queued: int = 8  # messages read ahead of the pipeline (gRPC flow control behind them)


class Inbound:
    """Async iterator over the client's messages with idle limits; `drain()` before an error."""

    def __init__(self, requests: AsyncIterator, limits: InboundLimits):
        self.limits = limits
        self._queue: asyncio.Queue = asyncio.Queue(limits.max_queued)
        self._discard = False
        self.num_messages = 0
        self.num_discarded = 0
        self._task = asyncio.get_running_loop().create_task(self._pump(requests))

    async def _pump(self, requests: AsyncIterator) -> None:
        item: object = _EOF
        try:
            async for msg in requests:
                if self._discard:
                    self.num_discarded += 1
                    continue
                await self._queue.put(msg)
        except Exception as exc:  # noqa: BLE001 - the consumer raises it where it reads
            item = exc
        if not self._discard:
            await self._queue.put(item)

    def _timeout(self) -> float:
        lim = self.limits
        if self.num_messages == 0:
            return lim.first_message_timeout
        if self.num_messages == 1:
            return lim.first_tokens_timeout
        return lim.idle_timeout

    def __aiter__(self) -> Inbound:
        return self

    async def __anext__(self):
        if self._queue.empty():
            item = await self._wait()
        else:  # read ahead already: no timer (wait_for would make a task for it)
            item = self._queue.get_nowait()
        if item is _EOF:
            self._queue.put_nowait(_EOF)  # later reads see the end again
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        self.num_messages += 1
        return item

    async def _wait(self):
        timeout = self._timeout()
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            what = ("a StreamConfig", "tokens", "tokens or EndOfInput")[min(self.num_messages, 2)]
            raise DeadlineExceeded(
                f"no {what} from the client for {timeout:g} s; the stream is closed"
            ) from None

    async def drain(self) -> None:
        """Read and discard the client's messages until it half-closes (or the drain timeout),
        so ending the call next cannot race one of its writes."""
        self._discard = True
        while not self._queue.empty():
            self._queue.get_nowait()  # unblocks a pump waiting to put
        await asyncio.wait({self._task}, timeout=self.limits.drain_timeout)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
