"""Talking to flow and vocoder replicas: flow calls with retry and voice-id reuse, vocoder
session calls, the translation of downstream statuses into the gateway's own errors."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from gateway.admission import CapacityBoard
from gateway.deadlines import slack_ms
from gateway.failover import RetryBudget, detach
from gateway.routing import ReplicaSet
from token2wav import MEL_BINS
from token2wav.errors import (
    Aborted,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    scrub,
)
from token2wav.lru import LRU
from token2wav.tensors import VoiceData, check_header, encode
from token2wav.v1 import common_pb2, flow_pb2, flow_pb2_grpc, vocoder_pb2, vocoder_pb2_grpc

logger = logging.getLogger(__name__)

_PASS_THROUGH = {
    grpc.StatusCode.ABORTED: Aborted,  # e.g. a vocoder session whose seq gap never filled
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def downstream_error(exc: grpc.aio.AioRpcError, what: str) -> Exception:
    """Capacity and availability problems pass through with their code; anything else a
    downstream service says about our own request is a gateway bug (INTERNAL). `what` names the
    stage, never a replica's address: the message goes to the client (addresses in the
    downstream's details are scrubbed too; the log has them)."""
    code = exc.code()
    if code == grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.UNAVAILABLE  # the replica shut down under the call
    cls = _PASS_THROUGH.get(code)
    if cls is not None:
        if code == grpc.StatusCode.UNAVAILABLE:
            return cls(f"{what}: no replica reachable, retry")
        return cls(f"{what}: {scrub(exc.details() or '')}")
    return RuntimeError(f"{what} failed with {code.name}: {exc.details()}")


# A replica that is down (UNAVAILABLE) or shutting down under the call (CANCELLED).
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


@dataclass
class FlowOutput:
    mel: common_pb2.Tensor  # (80, frames) float32 as the replica sent it: forwarded untouched
    num_frames: int
    queue_ms: float
    compute_ms: float
    batch_size: int


class KnownVoices:
    """Which voice ids each flow replica has confirmed (bounded), so repeat calls send only
    the id; a replica that evicted one answers NOT_FOUND and gets the voice inline again."""

    def __init__(self, max_per_replica: int = 4096):
        self.max = max_per_replica
        self._known: dict[str, LRU] = {}  # address -> voice ids

    def has(self, addr: str, voice_id: str) -> bool:
        return voice_id in self._known.get(addr, ())

    def add(self, addr: str, voice_id: str) -> None:
        self._known.setdefault(addr, LRU(self.max)).put(voice_id)

    def forget(self, addr: str, voice_id: str) -> None:
        if addr in self._known:
            self._known[addr].pop(voice_id)


class FlowClient:
    def __init__(
        self,
        replicas: ReplicaSet,
        max_attempts: int = 3,
        board: CapacityBoard | None = None,
        sticky: bool = True,
        budget: RetryBudget | None = None,
    ):
        self.replicas = replicas
        self.max_attempts = max_attempts
        self.sticky = sticky  # a stream's calls to its rendezvous replica, else round robin
        self.budget = budget or RetryBudget()
        self.known = KnownVoices()
        self.board = board or CapacityBoard()  # the replicas' reported capacity

    async def generate(
        self,
        *,
        request_id: str,
        seq: int,
        voice: VoiceData,
        tokens: np.ndarray,
        token_offset: int,
        finalize: bool,
        streaming: bool,
        timeout: float | None,
        due: float = math.inf,
    ) -> FlowOutput:
        """`due`: the chunk's playback deadline (monotonic s), sent as slack from each send."""
        # One request for every attempt: only the voice (id or inline) and the slack change.
        req = flow_pb2.GenerateRequest(
            request_id=request_id,
            seq=seq,
            tokens=encode(tokens.astype(np.int32)),
            token_offset=token_offset,
            finalize=finalize,
            streaming=streaming,
        )
        voice_id = voice.voice_id
        last: grpc.aio.AioRpcError | None = None
        # One replica per stream: its prefix cache holds what the stream's earlier calls computed
        if self.sticky and request_id:
            order = await self.replicas.ranked(request_id)
        else:
            order = await self.replicas.round_robin()
        self.budget.on_call()
        for attempt in range(self.max_attempts):
            addr = order[attempt % len(order)]
            stub = flow_pb2_grpc.FlowStub(self.replicas.channel(addr))
            inline = not self.known.has(addr, voice_id)
            for _ in range(2):  # a NOT_FOUND for the id is answered once with the voice inline
                if inline:  # the voice is a oneof: setting one side clears the other
                    req.inline_voice.CopyFrom(voice.to_proto())
                else:
                    req.voice_id = voice_id
                if due < math.inf:
                    req.slack_ms = slack_ms(due, time.monotonic())
                try:
                    resp = await stub.Generate(req, timeout=timeout)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND and not inline:
                        self.known.forget(addr, voice_id)
                        inline = True
                        continue
                    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise InvalidArgument(
                            "tokens", f"flow service rejected chunk {seq}: {exc.details()}"
                        ) from exc
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        raise NotFound(exc.details()) from exc
                    last = exc
                    break
                self.known.add(addr, voice_id)
                self.board.report(addr, resp.capacity_frames_per_s)
                _, frames = check_header(resp.mel, "mel", shape=(MEL_BINS, None))
                t = resp.timing
                return FlowOutput(resp.mel, frames, t.queue_ms, t.compute_ms, t.batch_size)
            if last is None or last.code() not in _RETRYABLE:
                break  # only a replica that is down or shutting down is worth another one
            self.replicas.eject(addr)
            if attempt + 1 == self.max_attempts or not self.budget.try_retry():
                break
            logger.warning(
                "flow replica %s unavailable (%s); retrying elsewhere", addr, last.details()
            )
        assert last is not None
        raise downstream_error(last, f"flow chunk {seq}")


__all__ = ["FlowClient", "FlowOutput", "downstream_error", "ServiceError"]


class VocoderClient:
    """Calls to the vocoder replicas: a stream's session, its cancellation, the replica to use.
    Which replica holds a stream's session, and what happens when it is lost, is the stream's
    (gateway/vocoder_stream.py); this holds the channels."""

    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas

    async def pick(self, request_id: str, exclude: set[str]) -> str:
        return await self.replicas.pick(request_id, exclude=exclude)

    def eject(self, addr: str) -> None:
        self.replicas.eject(addr)  # other streams avoid it too

    def session(self, addr: str, chunks: AsyncIterator, timeout: float | None):
        stub = vocoder_pb2_grpc.VocoderStub(self.replicas.channel(addr))
        return stub.Session(chunks, timeout=timeout)

    async def connected(self, addr: str, wait: float) -> None:
        """Wait at most `wait` s until `addr` is connected: after a restart of the only replica
        its channel fails fast until it reconnects, which the short reconnect backoff makes
        quick. A replica still down fails the next call, as another loss."""
        try:
            await asyncio.wait_for(self.replicas.channel(addr).channel_ready(), wait)
        except TimeoutError:
            pass

    def cancel(self, addr: str, session_id: str) -> asyncio.Task:
        """Drop a vocoder session now, not at its idle timeout, from a task the stream does not
        own (a cancelled stream must not cancel its own cleanup)."""
        stub = vocoder_pb2_grpc.VocoderStub(self.replicas.channel(addr))

        async def cancel() -> None:
            try:
                await stub.CancelSession(
                    vocoder_pb2.CancelSessionRequest(request_id=session_id), timeout=1.0
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    logger.warning("cancelling vocoder session: %s", exc.details())

        return detach(cancel(), f"cancel-session:{session_id}")
