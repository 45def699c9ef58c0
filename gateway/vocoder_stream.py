"""One stream's vocoder side: its Session with the replica that holds it, and the failover.

Chunks go out in seq order as the flow delivers them, audio comes back in seq order and is
handed to the stream for its client. A session lost on one replica (gateway/failover.py) is
reopened on another and replayed from chunk 0 (the stream keeps every mel chunk until it ends);
the replayed audio the client already has is checked against what it got and dropped, so the
client sees every sample once.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from gateway.downstream import FlowOutput, VocoderClient, downstream_error
from gateway.failover import SessionLost, count_failover, lost_reason
from gateway.schedule import FlowCall
from token2wav.errors import Aborted
from token2wav.tensors import check_header
from token2wav.v1 import vocoder_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkSource:
    """What the stream gives its vocoder side: the chunks, as the planner and the flow calls
    resolve them, and where the audio goes."""

    call: Callable[[int], asyncio.Future[FlowCall]]  # seq -> the chunk, once planned
    mel: Callable[[int], asyncio.Future[FlowOutput]]  # seq -> its flow result
    slack_ms: Callable[[FlowCall, int], float | None]  # the chunk's slack now (None: no deadline)
    sent: Callable[[], None]  # a new chunk (not a replayed one) went to a vocoder
    # (audio, its samples, samples to hold back): the client's response for it
    deliver: Callable[[vocoder_pb2.VocoderAudio, int, int], Awaitable[None]]
    total_samples: Callable[[], int]  # what the whole stream must come to, once it ended
    timeout: Callable[[], float | None]  # what the stream's deadline leaves for a session
    connect_wait: Callable[[], float]  # how long to wait for a replica to reconnect


class VocoderStream:
    def __init__(
        self,
        client: VocoderClient,
        request_id: str,
        source: ChunkSource,
        max_failovers: int,
        resume_from_sample: int = 0,
    ):
        self.client = client
        self.request_id = request_id
        self.source = source
        self.max_failovers = max_failovers
        self.resume_from_sample = resume_from_sample
        self.session_id = self._new_session_id()
        self.addr: str | None = None  # the replica of the current session
        self.finished = False  # the final chunk's audio came back
        self.num_failovers = 0
        self._num_sent = 0  # chunks sent to a vocoder (each counted by `source.sent` once)
        self._num_delivered = 0  # chunks whose audio went to the client
        self._delivered_sizes: list[int] = []  # [num_delivered] samples per delivered chunk

    def _new_session_id(self) -> str:
        # The vocoder session key is unique per stream and per failover, not the client's
        # request id alone: a client that reuses an id (a retry, a second utterance) must never
        # be answered from the finished session the vocoder still keeps for retries of the old
        # stream, nor a replay from a half-built one.
        return f"{self.request_id[:100]}:{uuid.uuid4().hex[:16]}"

    async def run(self) -> None:
        """Sessions until the final chunk's audio is back; raises the error of the last loss
        past `max_failovers`."""
        lost_on: set[str] = set()  # replicas that lost a session of this stream
        while True:
            self.addr = await self.client.pick(self.request_id, lost_on)
            if self.num_failovers:
                await self.client.connected(self.addr, self.source.connect_wait())
            try:
                await self._session(self.addr)
                break
            except SessionLost as lost:
                if self.num_failovers >= self.max_failovers:
                    raise lost.error from None
                self.num_failovers += 1
                count_failover(lost.reason)
                lost_on.add(lost.addr)
                if lost.reason in ("UNAVAILABLE", "CANCELLED"):
                    self.client.eject(lost.addr)
                self.client.cancel(lost.addr, self.session_id)  # it may still hold state
                self.session_id = self._new_session_id()
                logger.info(
                    "replaying %d chunks (%d delivered) in a new vocoder session",
                    self._num_sent,
                    self._num_delivered,
                )
        self.finished = True

    def cancel(self) -> asyncio.Task | None:
        """Drop the session of a stream that did not finish (the client left, or a failure)."""
        if self.finished or self.addr is None:
            return None
        return self.client.cancel(self.addr, self.session_id)

    @staticmethod
    async def _ready(fut: asyncio.Future, stop: asyncio.Future) -> bool:
        """Wait for `fut` (never cancelling it: others share it) unless `stop` comes first."""
        if not fut.done():
            await asyncio.wait({fut, stop}, return_when=asyncio.FIRST_COMPLETED)
        return fut.done()

    async def _chunks(self, session_id: str, stop: asyncio.Future):
        """Chunks from seq 0 for one session: a replay first (chunks sent to a lost session),
        then new chunks as flow delivers them. grpc.aio reads this from its own task, which
        nobody cancels when the call fails, so every wait also ends on `stop`."""
        seq = 0
        while True:
            if not await self._ready(self.source.call(seq), stop):
                return
            chunk = self.source.call(seq).result()
            if not await self._ready(self.source.mel(seq), stop):
                return
            msg = vocoder_pb2.VocoderChunk(request_id=session_id, seq=seq, finalize=chunk.finalize)
            # The flow replica's bytes, untouched. CopyFrom, not mel= in the constructor: that
            # one serialises and parses the tensor again.
            msg.mel.CopyFrom(self.source.mel(seq).result().mel)
            slack = self.source.slack_ms(chunk, seq)  # now: playback may have started meanwhile
            if slack is not None:
                msg.slack_ms = slack
            yield msg
            if seq == self._num_sent:  # a new chunk, not a replayed one
                self._num_sent += 1
                self.source.sent()
            if chunk.finalize:
                return
            seq += 1

    async def _session(self, addr: str) -> None:
        """One vocoder session on `addr`, from seq 0 to the final chunk; raises SessionLost."""
        stop = asyncio.get_running_loop().create_future()
        call = self.client.session(
            addr, self._chunks(self.session_id, stop), timeout=self.source.timeout()
        )
        expected_seq, expected_offset = 0, 0
        try:
            async for audio in call:
                if audio.seq != expected_seq or audio.sample_offset != expected_offset:
                    raise RuntimeError(
                        f"vocoder sent seq {audio.seq} @ {audio.sample_offset}, "
                        f"want {expected_seq} @ {expected_offset}"
                    )
                (num_samples,) = check_header(audio.audio, "audio", shape=(None,))
                if audio.seq < self._num_delivered:  # replayed: the client has it already
                    if num_samples != self._delivered_sizes[audio.seq]:
                        raise RuntimeError(
                            f"replayed chunk {audio.seq}: {num_samples} samples, "
                            f"delivered {self._delivered_sizes[audio.seq]}"
                        )
                else:
                    # The one place samples are held back: those a resumed stream's client has
                    # (all of a chunk before resume_from_sample, the head of the chunk it
                    # falls in). The final chunk always goes out, if empty, to end the stream.
                    skip = min(num_samples, max(0, self.resume_from_sample - expected_offset))
                    if skip < num_samples or audio.is_final:
                        await self.source.deliver(audio, num_samples, skip)
                    self._num_delivered += 1
                    self._delivered_sizes.append(num_samples)
                expected_seq += 1
                expected_offset += num_samples
                if audio.is_final:
                    break
        except grpc.aio.AioRpcError as exc:
            reason = lost_reason(exc)
            if reason is None:
                raise downstream_error(exc, "vocoder") from exc
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                error: Exception = downstream_error(exc, "vocoder")
            else:
                error = Aborted("vocoder lost this stream's session; retry the request")
            logger.warning("vocoder %s: session %s lost (%s)", addr, self.session_id, reason)
            raise SessionLost(addr, reason, error) from exc
        finally:
            call.cancel()
            if not stop.done():
                stop.set_result(None)
        total = self.source.total_samples()
        if expected_offset != total:
            raise RuntimeError(f"stream produced {expected_offset} samples, want {total}")
