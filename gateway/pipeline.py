"""One client stream: tokens in, ordered audio out.

Tasks per stream (all cancelled together when the client leaves or anything fails):
  reader   - client messages -> the token list (validated), until EndOfInput
  planner  - launches a flow call as soon as the schedule allows (bounded in-flight chunks)
  flow[k]  - one Generate call per chunk; results may come back in any order
  vocoder  - one Session stream to the stream's vocoder replica: mel chunks go out in seq order,
             audio comes back in seq order and is converted for the client
The handler yields audio from a bounded queue, so a slow client slows its own stream only
(gRPC flow control upstream of the queue, bounded in-flight chunks downstream).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from gateway.deadlines import DeadlineConfig, PlaybackClock, slack_ms
from gateway.downstream import FlowClient, FlowOutput, downstream_error
from gateway.routing import ReplicaSet
from gateway.schedule import Chunk, ChunkPlanner, ScheduleConfig
from token2wav import MAX_FRAMES, SAMPLE_RATE, SAMPLES_PER_TOKEN, TOKEN_MEL_RATIO, VOCAB_SIZE
from token2wav.errors import Aborted, InvalidArgument
from token2wav.tensors import VoiceData, decode, encode
from token2wav.v1 import common_pb2, gateway_pb2, vocoder_pb2, vocoder_pb2_grpc

logger = logging.getLogger(__name__)
_CORE_WRITE_ERROR = "Internal error from Core"  # grpc.aio: a write failed on a finished call


@dataclass(frozen=True)
class PipelineLimits:
    max_inflight_chunks: int = 4  # flow calls out at once per stream
    max_buffered_chunks: int = 4  # audio chunks waiting for a slow client
    call_timeout_cap: float = 60.0  # s, cap on any downstream call's deadline
    # Playback deadlines sent downstream as slack (gateway/deadlines.py); None: none sent.
    deadlines: DeadlineConfig | None = DeadlineConfig()


@dataclass
class StreamSetup:
    request_id: str
    voice: VoiceData
    audio_format: int  # gateway_pb2.AudioFormat, never UNSPECIFIED
    schedule: ScheduleConfig
    deadline: float | None  # monotonic, from the client's deadline


def to_client_audio(samples: np.ndarray, audio_format: int) -> bytes:
    if audio_format == gateway_pb2.AUDIO_FORMAT_FLOAT32:
        return samples.astype("<f4").tobytes()
    return np.clip(np.round(samples * 32767.0), -32768, 32767).astype("<i2").tobytes()


class StreamPipeline:
    def __init__(
        self, setup: StreamSetup, flow: FlowClient, vocoders: ReplicaSet, limits: PipelineLimits
    ):
        self.setup = setup
        self.flow = flow
        self.vocoders = vocoders
        self.limits = limits
        n_p = setup.voice.num_prompt_tokens
        self.max_tokens = MAX_FRAMES // TOKEN_MEL_RATIO - n_p  # the 300 s noise buffers
        self.tokens = np.zeros(self.max_tokens, np.int64)
        self.num_tokens = 0
        self.ended = False
        self.planner = ChunkPlanner(n_p, setup.schedule)
        self._changed = asyncio.Event()
        self._slots = asyncio.Semaphore(limits.max_inflight_chunks)
        self._chunks: dict[int, Chunk] = {}  # seq -> chunk
        self._ready_at: dict[int, float] = {}  # seq -> when its tokens were all in
        self.playback = PlaybackClock(limits.deadlines) if limits.deadlines else None
        self._due: dict[int, float] = {}  # seq -> playback deadline sent to the flow service
        self._mels: dict[int, asyncio.Future[FlowOutput]] = {}  # seq -> flow result
        self._planned = asyncio.Condition()
        self._out: asyncio.Queue = asyncio.Queue(limits.max_buffered_chunks)
        self._failure: asyncio.Future = asyncio.get_running_loop().create_future()
        self._tasks: list[asyncio.Task] = []
        self._vocoder_addr: str | None = None
        self._finished = False
        # The vocoder session key is unique per stream, not the client's request id alone: a
        # client that reuses an id (a retry, a second utterance) must never be answered from the
        # finished session the vocoder still keeps for retries of the old stream.
        self.session_id = f"{setup.request_id[:100]}:{uuid.uuid4().hex[:16]}"

    # -- helpers -----------------------------------------------------------------------------
    def _timeout(self) -> float | None:
        cap = self.limits.call_timeout_cap
        if self.setup.deadline is None:
            return cap
        return max(0.001, min(cap, self.setup.deadline - time.monotonic()))

    def _spawn(self, coro, name: str) -> asyncio.Task:
        async def guarded():
            try:
                await coro
            except asyncio.CancelledError:
                # grpc.aio raises CancelledError, not an RpcError, for a call whose channel was
                # closed under it (a replica's --retire-grace ran out, or shutdown). Only a
                # cancellation of this task is ours; the other is a failed stream, and left
                # unreported it would hang the stream until its deadline. (Python >= 3.11
                # tells them apart; 3.10 treats both as ours.)
                cancelling = getattr(asyncio.current_task(), "cancelling", None)
                if cancelling is None or cancelling() > 0:
                    raise
                if not self._failure.done():
                    self._failure.set_exception(
                        Aborted(f"{name}: a downstream call was cancelled under the stream")
                    )
            except Exception as exc:  # noqa: BLE001 - the first failure ends the stream
                if not self._failure.done():
                    self._failure.set_exception(exc)

        task = asyncio.get_running_loop().create_task(
            guarded(), name=f"{self.setup.request_id}:{name}"
        )
        self._tasks.append(task)
        return task

    # -- reader ------------------------------------------------------------------------------
    async def _read(self, requests: AsyncIterator) -> None:
        async for msg in requests:
            kind = msg.WhichOneof("message")
            if self.ended:
                raise InvalidArgument(kind or "message", "message after EndOfInput")
            if kind == "tokens":
                ids = np.asarray(msg.tokens.tokens, np.int64)
                bad = np.flatnonzero(ids >= VOCAB_SIZE)
                if bad.size:
                    i = int(bad[0])
                    raise InvalidArgument(
                        f"tokens.tokens[{i}]", f"id {int(ids[i])} outside 0..{VOCAB_SIZE - 1}"
                    )
                if self.num_tokens + ids.size > self.max_tokens:
                    raise InvalidArgument(
                        "tokens",
                        f"more than {self.max_tokens} tokens: prompt + target would exceed 300 s",
                    )
                self.tokens[self.num_tokens : self.num_tokens + ids.size] = ids
                self.num_tokens += ids.size
            elif kind == "end":
                self.ended = True
            elif kind == "config":
                raise InvalidArgument("config", "sent twice; StreamConfig comes first, once")
            else:
                raise InvalidArgument("message", "empty SynthesizeRequest")
            self._changed.set()
        if not self.ended:
            raise InvalidArgument(
                "end",
                "stream closed without EndOfInput (a half-close alone does not end the input)",
            )

    # -- planner and flow calls --------------------------------------------------------------
    async def _plan(self) -> None:
        while not self.planner.done:
            await self._changed.wait()
            self._changed.clear()
            while (chunk := self.planner.next_chunk(self.num_tokens, self.ended)) is not None:
                # The clock starts when the tokens are in, so time spent waiting for a slot
                # counts as the gateway's (gateway_ms), not as transport.
                ready_at = time.monotonic()
                if self.playback is not None:
                    self._due[chunk.seq] = self.playback.due(chunk, ready_at)
                await self._slots.acquire()  # bounded in-flight chunks per stream
                self._chunks[chunk.seq] = chunk
                self._ready_at[chunk.seq] = ready_at
                fut = asyncio.get_running_loop().create_future()
                self._mels[chunk.seq] = fut
                tokens = self.tokens[: chunk.num_tokens].copy()
                self._spawn(self._flow(chunk, tokens, fut), f"flow{chunk.seq}")
                async with self._planned:
                    self._planned.notify_all()
        if self.planner.seq == 0:
            raise InvalidArgument("tokens", "the stream ended without any token")

    async def _flow(self, chunk: Chunk, tokens: np.ndarray, fut: asyncio.Future) -> None:
        out = await self.flow.generate(
            request_id=self.setup.request_id,
            seq=chunk.seq,
            voice=self.setup.voice,
            tokens=tokens,
            token_offset=chunk.token_offset,
            finalize=chunk.finalize,
            streaming=chunk.streaming,
            timeout=self._timeout(),
            due=self._due.get(chunk.seq, math.inf),
        )
        expected = TOKEN_MEL_RATIO * chunk.num_emit_tokens
        if out.mel.shape[1] != expected:
            raise RuntimeError(
                f"flow chunk {chunk.seq}: {out.mel.shape[1]} frames, want {expected}"
            )
        fut.set_result(out)

    # -- vocoder session ---------------------------------------------------------------------
    async def _chunk(self, seq: int) -> Chunk:
        async with self._planned:
            await self._planned.wait_for(lambda: seq in self._chunks)
        return self._chunks[seq]

    async def _vocoder_requests(self):
        seq = 0
        while True:
            chunk = await self._chunk(seq)
            out = await self._mels[seq]
            msg = vocoder_pb2.VocoderChunk(
                request_id=self.session_id,
                seq=seq,
                mel=encode(out.mel),
                finalize=chunk.finalize,
            )
            if self.playback is not None:  # recomputed: playback may have started meanwhile
                due = self.playback.due(chunk, self._ready_at[seq])
                msg.slack_ms = slack_ms(due, time.monotonic())
            yield msg
            self._slots.release()
            if chunk.finalize:
                return
            seq += 1

    async def _vocode(self) -> None:
        rid = self.setup.request_id
        self._vocoder_addr = await self.vocoders.pick(rid)
        stub = vocoder_pb2_grpc.VocoderStub(self.vocoders.channel(self._vocoder_addr))
        call = stub.Session(self._vocoder_requests(), timeout=self._timeout_stream())
        expected_seq, expected_offset = 0, 0
        try:
            async for audio in call:
                if audio.seq != expected_seq or audio.sample_offset != expected_offset:
                    raise RuntimeError(
                        f"vocoder sent seq {audio.seq} @ {audio.sample_offset}, "
                        f"want {expected_seq} @ {expected_offset}"
                    )
                samples = decode(audio.audio, "audio", shape=(None,))
                flow_out = self._mels[audio.seq].result()
                fmt = self.setup.audio_format
                msg = gateway_pb2.SynthesizeResponse(
                    request_id=rid,
                    seq=audio.seq,
                    sample_offset=audio.sample_offset,
                    sample_rate=SAMPLE_RATE,
                    audio_format=fmt,
                    audio=to_client_audio(samples, fmt),
                    num_samples=samples.size,
                    is_final=audio.is_final,
                    timing=gateway_pb2.ChunkTiming(
                        flow_queue_ms=flow_out.queue_ms,
                        flow_compute_ms=flow_out.compute_ms,
                        flow_batch_size=flow_out.batch_size,
                        vocoder_queue_ms=audio.timing.queue_ms,
                        vocoder_compute_ms=audio.timing.compute_ms,
                        vocoder_batch_size=audio.timing.batch_size,
                    ),
                )
                await self._out.put((msg, self._ready_at[audio.seq]))
                expected_seq += 1
                expected_offset += samples.size
                if audio.is_final:
                    break
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                # The replica lost the session mid-stream (restarted, or evicted it): the audio
                # state is gone, so this stream cannot go on; the client may retry the request.
                raise Aborted(
                    f"vocoder {self._vocoder_addr} lost this stream's session: {exc.details()}"
                ) from exc
            if exc.code() == grpc.StatusCode.INTERNAL and exc.details() == _CORE_WRITE_ERROR:
                # grpc.aio replaces the server's status with this when the server ends the call
                # while one of our writes is in flight: the vocoder ended the session's stream
                # early (any reason), not a fault of ours, and the stream cannot go on.
                raise Aborted(
                    f"vocoder {self._vocoder_addr} ended this stream's session call early"
                ) from exc
            raise downstream_error(exc, f"vocoder {self._vocoder_addr}") from exc
        total = SAMPLES_PER_TOKEN * self.num_tokens
        if expected_offset != total:
            raise RuntimeError(f"stream produced {expected_offset} samples, want {total}")
        self._finished = True
        await self._out.put(None)

    def _timeout_stream(self) -> float | None:
        if self.setup.deadline is None:
            return None  # a live stream may last as long as its LLM talks
        return max(0.001, self.setup.deadline - time.monotonic())

    # -- admission's view ---------------------------------------------------------------------
    def remaining_work(self, now: float, expected_tokens: int) -> list[tuple[float, int]]:
        """(deadline, DiT frames) of every flow call this stream still needs: those out or
        planned and not answered, then the chunks its schedule will still make, up to the
        tokens received (input ended) or `expected_tokens` (input open)."""
        n_p = self.setup.voice.num_prompt_tokens
        clock = self.playback or PlaybackClock(DeadlineConfig())
        items = []
        for seq, chunk in list(self._chunks.items()):
            fut = self._mels.get(seq)
            if fut is None or not fut.done():
                due = self._due.get(seq)
                if due is None:
                    due = clock.due(chunk, self._ready_at[seq], project=True)
                items.append((due, TOKEN_MEL_RATIO * (n_p + chunk.num_tokens)))
        planner = copy.copy(self.planner)
        total = self.num_tokens if self.ended else max(expected_tokens, self.num_tokens + 1)
        while (chunk := planner.next_chunk(total, True)) is not None:
            due = clock.due(chunk, now, project=True)
            items.append((due, TOKEN_MEL_RATIO * (n_p + chunk.num_tokens)))
        return items

    # -- the whole stream --------------------------------------------------------------------
    async def run(self, requests: AsyncIterator) -> AsyncIterator[gateway_pb2.SynthesizeResponse]:
        self._spawn(self._read(requests), "reader")
        self._spawn(self._plan(), "planner")
        self._spawn(self._vocode(), "vocoder")
        try:
            while True:
                get = asyncio.ensure_future(self._out.get())
                await asyncio.wait({get, self._failure}, return_when=asyncio.FIRST_COMPLETED)
                if self._failure.done():
                    get.cancel()
                    raise self._failure.exception()
                item = get.result()
                if item is None:
                    return
                msg, ready_at = item
                msg.timing.gateway_ms = (time.monotonic() - ready_at) * 1e3
                if self.playback is not None:
                    self.playback.sent(msg.num_samples / SAMPLE_RATE)
                yield msg
        finally:
            await self.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if not self._failure.done():
            self._failure.cancel()
        elif not self._failure.cancelled():
            self._failure.exception()  # retrieved: a cancelled client also ends the reader
        if not self._finished and self._vocoder_addr is not None:
            # The client left or something failed: drop the session now, not at its idle timeout.
            stub = vocoder_pb2_grpc.VocoderStub(self.vocoders.channel(self._vocoder_addr))
            try:
                await stub.CancelSession(
                    vocoder_pb2.CancelSessionRequest(request_id=self.session_id), timeout=1.0
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    logger.warning("cancelling vocoder session: %s", exc.details())


__all__ = ["PipelineLimits", "StreamPipeline", "StreamSetup", "common_pb2"]
