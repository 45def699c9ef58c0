"""One client stream: tokens in, ordered audio out.

Tasks per stream (all cancelled together when the client leaves or anything fails):
  reader   - client messages -> the token list (validated), until EndOfInput
  planner  - when the schedule says chunk k is due, makes its flow call (bounded chunks ahead
             of the vocoder); with block calls, assembles it from its blocks instead, the final
             chunk excepted
  blocks   - with block calls (--block-calls) only: one Generate call per run of 25-token blocks
             whose tokens + 3 lookahead are in (gateway/schedule.py, "Block calls"), bounded in
             flight; each block computed once
  vocoder  - one Session stream to the stream's vocoder replica: mel chunks go out in seq order,
             audio comes back in seq order and is converted for the client; a lost session is
             reopened elsewhere and replayed (gateway/vocoder_stream.py)
The handler yields audio from a bounded queue, so a slow client slows its own stream only
(gRPC flow control upstream of the queue, bounded in-flight chunks downstream).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from gateway.admission import remaining_work
from gateway.deadlines import DeadlineConfig, PlaybackClock, slack_ms
from gateway.downstream import FlowClient, FlowOutput, VocoderClient
from gateway.failover import detach
from gateway.schedule import (
    LOOKAHEAD_TOKENS,
    BlockPlanner,
    ChunkPlanner,
    FlowCall,
    ScheduleConfig,
)
from gateway.vocoder_stream import ChunkSource, VocoderStream
from token2wav import MAX_FRAMES, MEL_BINS, SAMPLE_RATE, SAMPLES_PER_TOKEN, TOKEN_MEL_RATIO
from token2wav.errors import Aborted, InvalidArgument
from token2wav.tensors import VoiceData, check_token_ids, decode, encode
from token2wav.v1 import common_pb2, gateway_pb2, vocoder_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineLimits:
    max_inflight_chunks: int = 4  # flow calls out at once per stream
    max_buffered_chunks: int = 4  # audio chunks waiting for a slow client
    call_timeout_cap: float = 60.0  # s, cap on any downstream call's deadline
    # Playback deadlines sent downstream as slack (gateway/deadlines.py).
    deadlines: DeadlineConfig = DeadlineConfig()
    max_vocoder_failovers: int = 3  # times a stream may reopen its session on another replica
    failover_connect_wait: float = 5.0  # s a failover waits for its replica to (re)connect
    # A stream whose input is still open when its first audio is ready gets that audio no
    # earlier than this long after the first chunk's tokens (a start buffer, see `_hold_first`).
    start_buffer_s: float = 0.0
    schedule: ScheduleConfig = ScheduleConfig()  # for streams that set none (--schedule)
    # Off by default because it measured worse (docs/bench/2026-12-04-block-calls-and-prefix-
    # graphs.md): even with graphs reading the cache, a flow solve of any size costs ~5 ms a step,
    # and a stream makes ~10 block calls where it makes 4 chunk calls. It pays once a small
    # solve costs much less than a chunk's.
    block_calls: bool = False

    def __post_init__(self):
        if self.start_buffer_s < 0:
            raise ValueError("--start-buffer-ms: want >= 0")


@dataclass
class StreamSetup:
    request_id: str
    voice: VoiceData
    audio_format: int  # gateway_pb2.AudioFormat, never UNSPECIFIED
    schedule: ScheduleConfig
    deadline: float | None  # monotonic, from the client's deadline
    # A resumed stream (StreamConfig.resume_from_sample): the client has the samples before it.
    resume_from_sample: int = 0
    start_buffer_s: float | None = None  # StreamConfig.start_buffer_ms; None: the gateway's


def to_client_audio(audio: common_pb2.Tensor, audio_format: int, skip: int = 0) -> bytes:
    """The vocoder's float32 samples (header checked) from sample `skip` on, in the client's
    format: float32 passes through as it came (little-endian on both wires), int16 is rounded
    and clipped."""
    if audio_format == gateway_pb2.AUDIO_FORMAT_FLOAT32:
        return audio.data[4 * skip :]
    samples = decode(audio, "audio", shape=(None,))[skip:]  # a fresh copy: scaled in place
    samples *= 32767.0
    np.rint(samples, out=samples)  # what np.round does (half to even), without a new array
    np.clip(samples, -32768, 32767, out=samples)
    return samples.astype("<i2").tobytes()


def _concat(parts: list[FlowOutput]) -> FlowOutput:
    """One chunk's mel from its block calls' (80, frames) pieces; the timing of the last piece,
    the call the chunk waited for."""
    mel = np.concatenate([decode(p.mel, "mel", shape=(MEL_BINS, None)) for p in parts], axis=1)
    last = parts[-1]
    return FlowOutput(encode(mel), mel.shape[1], last.queue_ms, last.compute_ms, last.batch_size)


class StreamPipeline:
    def __init__(
        self,
        setup: StreamSetup,
        flow: FlowClient,
        vocoders: VocoderClient,
        limits: PipelineLimits,
        observe_lateness: Callable[[float], None] | None = None,
    ):
        self.setup = setup
        # called with (send time - when the player needed it) of every chunk after the first
        self.observe_lateness = observe_lateness
        self.flow = flow
        self.limits = limits
        n_p = setup.voice.num_prompt_tokens
        self.max_tokens = MAX_FRAMES // TOKEN_MEL_RATIO - n_p  # the 300 s noise buffers
        self.tokens = np.zeros(self.max_tokens, np.int64)
        self.num_tokens = 0
        self.ended = False
        self.planner = ChunkPlanner(n_p, setup.schedule)
        self.blocks = BlockPlanner(n_p, setup.schedule)
        # target token where a block call starts -> its result and its end token
        self._block_out: dict[int, asyncio.Future[tuple[FlowOutput, int]]] = {}
        self._block_slots = asyncio.Semaphore(limits.max_inflight_chunks)
        self._blocks_changed = asyncio.Event()  # tokens came: maybe a block call to make
        self._blocks_done = asyncio.Event()  # no more block calls will be made
        self._streaming_end: int | None = None  # once ended: tokens the streaming chunks use
        self._changed = asyncio.Event()
        self._slots = asyncio.Semaphore(limits.max_inflight_chunks)
        self._flow_calls: dict[int, asyncio.Future[FlowCall]] = {}  # seq -> chunk, once planned
        self._ready_at: dict[int, float] = {}  # seq -> when its tokens were all in
        self.playback = PlaybackClock(limits.deadlines)
        self._due: dict[int, float] = {}  # seq -> playback deadline sent to the flow service
        # seq -> flow result; kept until the stream ends (bounded: 300 s of mel is 4.8 MB), so
        # a lost vocoder session can be replayed on another replica.
        self._mels: dict[int, asyncio.Future[FlowOutput]] = {}
        self._out: asyncio.Queue = asyncio.Queue(limits.max_buffered_chunks)
        self._failure: asyncio.Future = asyncio.get_running_loop().create_future()
        self._tasks: list[asyncio.Task] = []
        source = ChunkSource(
            call=self._flow_call_future,
            mel=lambda seq: self._mels[seq],
            slack_ms=self._slack_ms,
            sent=self._slots.release,  # each new chunk sent frees an in-flight slot once
            deliver=self._deliver,
            total_samples=lambda: SAMPLES_PER_TOKEN * self.num_tokens,
            timeout=self._timeout_stream,
            connect_wait=self._connect_wait,
        )
        self.vocoder = VocoderStream(
            vocoders,
            setup.request_id,
            source,
            limits.max_vocoder_failovers,
            setup.resume_from_sample,
        )

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
                # closed under it (a retiring replica's grace ran out, or shutdown). Only a
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
        # A task cancelled before its first step never starts `coro`; close it so Python does
        # not warn that it was never awaited (a no-op once it ran).
        task.add_done_callback(lambda _: coro.close())
        self._tasks.append(task)
        return task

    # -- reader ------------------------------------------------------------------------------
    async def _read(self, requests: AsyncIterator) -> None:
        async for msg in requests:
            kind = msg.WhichOneof("message")
            if self.ended:
                raise InvalidArgument(kind or "message", "message after EndOfInput")
            if kind == "tokens":
                # uint64 on the wire
                ids = check_token_ids(np.asarray(msg.tokens.tokens, np.uint64), "tokens.tokens")
                if self.num_tokens + ids.size > self.max_tokens:
                    raise InvalidArgument(
                        "tokens",
                        f"more than {self.max_tokens} tokens: prompt + target would exceed 300 s",
                    )
                self.tokens[self.num_tokens : self.num_tokens + ids.size] = ids
                self.num_tokens += ids.size
            elif kind == "end":
                self.ended = True
                total = SAMPLES_PER_TOKEN * self.num_tokens
                if self.setup.resume_from_sample > total:
                    raise InvalidArgument(
                        "config.resume_from_sample",
                        f"{self.setup.resume_from_sample} is past the end of the audio "
                        f"({total} samples for the {self.num_tokens} tokens sent)",
                    )
            elif kind == "config":
                raise InvalidArgument("config", "sent twice; StreamConfig comes first, once")
            else:
                raise InvalidArgument("message", "empty SynthesizeRequest")
            self._changed.set()
            self._blocks_changed.set()
        if not self.ended:
            raise InvalidArgument(
                "end",
                "stream closed without EndOfInput (a half-close alone does not end the input)",
            )

    # -- block calls, planner and flow calls -------------------------------------------------
    def _block_future(self, start: int) -> asyncio.Future[tuple[FlowOutput, int]]:
        fut = self._block_out.get(start)
        if fut is None:
            fut = self._block_out[start] = asyncio.get_running_loop().create_future()
            # a block computed ahead for a chunk the input ended inside is never awaited
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return fut

    def _blocks_wanted(self) -> int:
        """Tokens the block calls may use: all received while the input is open; after the
        end, only those of the streaming chunks still to come (the rest go to the final call)."""
        if not self.ended:
            return self.num_tokens
        if self._streaming_end is None:
            self._streaming_end = self.blocks.streaming_end(self.num_tokens)
        return self._streaming_end

    async def _compute_blocks(self) -> None:
        while True:
            while (call := self.blocks.next_call(self._blocks_wanted())) is not None:
                await self._block_slots.acquire()
                tokens = self.tokens[: call.num_tokens].copy()
                self._spawn(self._block(call, tokens), f"block{call.seq}")
            if self.ended:
                self._blocks_done.set()
                return
            await self._blocks_changed.wait()
            self._blocks_changed.clear()

    async def _block(self, call: FlowCall, tokens: np.ndarray) -> None:
        fut = self._block_future(call.token_offset)
        end = call.num_tokens - LOOKAHEAD_TOKENS
        try:
            out = await self._call_flow(call, tokens, self._block_due(call))
            fut.set_result((out, end))
        except Exception as exc:  # noqa: BLE001 - the chunk that needs it fails with it
            fut.set_exception(exc)
        finally:
            self._block_slots.release()

    def _block_due(self, call: FlowCall) -> float:
        """The playback deadline of the chunk this block goes out in (projected: its tokens
        may not all be in yet)."""
        chunk = self.blocks.chunk_of(call.token_offset)
        return self.playback.due(chunk, time.monotonic(), project=True)

    async def _plan(self) -> None:
        while not self.planner.done:
            await self._changed.wait()
            self._changed.clear()
            while (chunk := self.planner.next_call(self.num_tokens, self.ended)) is not None:
                # The clock starts when the tokens are in, so time spent waiting for a slot
                # counts as the gateway's (gateway_ms), not as transport.
                ready_at = time.monotonic()
                self._due[chunk.seq] = self.playback.due(chunk, ready_at)
                await self._slots.acquire()  # bounded chunks ahead of the vocoder
                self._ready_at[chunk.seq] = ready_at
                fut = asyncio.get_running_loop().create_future()
                self._mels[chunk.seq] = fut
                if chunk.finalize or not self.limits.block_calls:
                    tokens = self.tokens[: chunk.num_tokens].copy()
                    self._spawn(self._flow(chunk, tokens, fut), f"flow{chunk.seq}")
                else:
                    self._spawn(self._assemble(chunk, fut), f"chunk{chunk.seq}")
                self._flow_call_future(chunk.seq).set_result(chunk)
        if self.planner.seq == 0:
            raise InvalidArgument("tokens", "the stream ended without any token")

    async def _assemble(self, chunk: FlowCall, fut: asyncio.Future) -> None:
        """A streaming chunk: the frames of its block calls, in order."""
        parts, start, end = [], chunk.token_offset, chunk.num_tokens - LOOKAHEAD_TOKENS
        while start < end:
            out, start = await self._block_future(start)
            parts.append(out)
        fut.set_result(_concat(parts) if len(parts) > 1 else parts[0])

    async def _flow(self, chunk: FlowCall, tokens: np.ndarray, fut: asyncio.Future) -> None:
        """A chunk in one flow call: the final one, or any one without block calls."""
        if chunk.finalize and self.limits.block_calls:
            # After every block call of the stream: the final call ends the stream's cache
            # entry on the flow replica, which a block call still running would store again.
            await self._blocks_done.wait()
            pending = [f for f in self._block_out.values() if not f.done()]
            if pending:
                await asyncio.wait(pending)
        fut.set_result(await self._call_flow(chunk, tokens, self._due.get(chunk.seq, math.inf)))

    async def _call_flow(self, call: FlowCall, tokens: np.ndarray, due: float) -> FlowOutput:
        out = await self.flow.generate(
            request_id=self.setup.request_id,
            seq=call.seq,
            voice=self.setup.voice,
            tokens=tokens,
            token_offset=call.token_offset,
            finalize=call.finalize,
            streaming=call.streaming,
            timeout=self._timeout(),
            due=due,
        )
        expected = TOKEN_MEL_RATIO * call.num_emit_tokens
        if out.num_frames != expected:
            raise RuntimeError(f"flow call {call.seq}: {out.num_frames} frames, want {expected}")
        return out

    # -- vocoder session ---------------------------------------------------------------------
    def _flow_call_future(self, seq: int) -> asyncio.Future[FlowCall]:
        fut = self._flow_calls.get(seq)
        if fut is None:
            fut = self._flow_calls[seq] = asyncio.get_running_loop().create_future()
        return fut

    def _slack_ms(self, chunk: FlowCall, seq: int) -> float:
        return slack_ms(self.playback.due(chunk, self._ready_at[seq]), time.monotonic())

    async def _deliver(self, audio: vocoder_pb2.VocoderAudio, num_samples: int, skip: int):
        """Queue the client's response for a vocoder chunk, less its first `skip` samples."""
        flow_out = self._mels[audio.seq].result()
        fmt = self.setup.audio_format
        msg = gateway_pb2.SynthesizeResponse(
            request_id=self.setup.request_id,
            seq=audio.seq,
            sample_offset=audio.sample_offset + skip,
            sample_rate=SAMPLE_RATE,
            audio_format=fmt,
            audio=to_client_audio(audio.audio, fmt, skip),
            num_samples=num_samples - skip,
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

    async def _vocode(self) -> None:
        await self.vocoder.run()
        await self._out.put(None)

    def _connect_wait(self) -> float:
        wait = self.limits.failover_connect_wait
        if self.setup.deadline is not None:
            wait = min(wait, max(0.0, self.setup.deadline - time.monotonic()))
        return wait

    def _timeout_stream(self) -> float | None:
        if self.setup.deadline is None:
            return None  # a live stream may last as long as its LLM talks
        return max(0.001, self.setup.deadline - time.monotonic())

    # -- admission's view ---------------------------------------------------------------------
    def remaining_work(self, now: float, expected_tokens: int) -> list[tuple[float, int]]:
        """(deadline, DiT frames) of every flow call this stream still needs, as admission
        counts them (gateway/admission.py `remaining_work`)."""
        in_flight = [
            (planned.result(), self._due.get(seq), self._ready_at[seq])
            for seq, planned in list(self._flow_calls.items())
            if planned.done() and not (seq in self._mels and self._mels[seq].done())
        ]
        n_p = self.setup.voice.num_prompt_tokens
        return remaining_work(
            self.planner,
            self.playback,
            n_p,
            in_flight,
            self.num_tokens,
            self.ended,
            now,
            expected_tokens,
        )

    # -- the whole stream --------------------------------------------------------------------
    async def run(self, requests: AsyncIterator) -> AsyncIterator[gateway_pb2.SynthesizeResponse]:
        self._spawn(self._read(requests), "reader")
        self._spawn(self._plan(), "planner")
        if self.limits.block_calls:
            self._spawn(self._compute_blocks(), "blocks")
        self._spawn(self._vocode(), "vocoder")
        get: asyncio.Future | None = None
        try:
            while True:
                if self._out.empty():  # wait for a chunk or a failure (a task for the get)
                    get = asyncio.ensure_future(self._out.get())
                    await asyncio.wait({get, self._failure}, return_when=asyncio.FIRST_COMPLETED)
                if self._failure.done():
                    raise self._failure.exception()
                item = get.result() if get is not None else self._out.get_nowait()
                get = None
                if item is None:
                    return
                msg, ready_at = item
                if msg.seq == 0:
                    await self._hold_first(ready_at)
                msg.timing.gateway_ms = (time.monotonic() - ready_at) * 1e3
                if msg.seq > 0 and self.observe_lateness is not None:
                    chunk = self._flow_calls[msg.seq].result()
                    needed = self.playback.needed_at(chunk, ready_at, project=True)
                    self.observe_lateness(time.monotonic() - needed)
                self.playback.sent(msg.num_samples / SAMPLE_RATE)
                yield msg
        finally:
            if get is not None:
                get.cancel()
            await self.close()

    async def _hold_first(self, ready_at: float) -> None:
        """The start buffer. Tokens paced by a language model put some chunks on a zero-slack
        boundary (their tokens complete just as the audio before them runs out), where any
        wait for the GPU becomes a pause in playback; starting playback a little later gives
        every later chunk that much slack. A first chunk later than the buffer goes out at once;
        a stream whose input has ended needs no buffer (all its chunks can be computed ahead)."""
        buffer = self.setup.start_buffer_s
        if buffer is None:
            buffer = self.limits.start_buffer_s
        wait = ready_at + buffer - time.monotonic()
        if wait <= 0 or self.ended:
            return
        await asyncio.wait({self._failure}, timeout=wait)
        if self._failure.done():
            raise self._failure.exception()

    async def close(self) -> None:
        # The cleanup runs in a task of its own: when the client left, this coroutine is being
        # cancelled, and a second cancellation must not cut the CancelSession short.
        await asyncio.shield(detach(self._cleanup(), f"close:{self.vocoder.session_id}"))

    async def _cleanup(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if not self._failure.done():
            self._failure.cancel()
        elif not self._failure.cancelled():
            self._failure.exception()  # retrieved: a cancelled client also ends the reader
        cancel = self.vocoder.cancel()  # the client left or something failed: drop it now,
        if cancel is not None:  # not at the session's idle timeout
            await cancel


__all__ = ["PipelineLimits", "StreamPipeline", "StreamSetup", "common_pb2"]
