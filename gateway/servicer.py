"""The public Gateway service: Synthesize streams, RegisterVoice, DeleteVoice."""

from __future__ import annotations

import logging
import time
import uuid

from gateway import metrics
from gateway.admission import AdmissionConfig, AdmissionController
from gateway.audio_format import ClientAudio, OutputSpec, check_output
from gateway.callers import ClientStreams, client_of
from gateway.deadlines import MAX_START_BUFFER_MS
from gateway.downstream import FlowClient, VocoderClient
from gateway.inbound import Inbound, InboundLimits
from gateway.pipeline import PipelineLimits, StreamPipeline, StreamSetup
from gateway.routing import ReplicaSet
from gateway.schedule import ScheduleConfig
from gateway.voices import VoiceMaker, voice_from_request
from token2wav import MAX_FRAMES, SAMPLES_PER_TOKEN, TOKEN_MEL_RATIO, tracing
from token2wav.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    announce_status,
    check_request_id,
)
from token2wav.lru import LRU
from token2wav.server import request_id_var
from token2wav.tensors import VoiceData, decode_voice, encode
from token2wav.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)

MAX_SAMPLES = MAX_FRAMES // TOKEN_MEL_RATIO * SAMPLES_PER_TOKEN  # 300 s, prompt included


class VoiceRegistry:
    """Registered voices by content-addressed id (LRU, bounded), each owned by the clients that
    registered it: only they may use or delete it (others get NOT_FOUND, as for an unknown id),
    and a client past its own quota evicts its own oldest voice, never another client's."""

    def __init__(self, max_voices: int = 1024, max_per_client: int = 0):
        self.max_voices = max_voices
        self.max_per_client = max_per_client  # 0: only the global bound
        self._voices = LRU(max_voices)  # voice_id -> voice
        self._owners: dict[str, set[str]] = {}  # voice_id -> clients that registered it
        self._owned: dict[str, LRU] = {}  # client -> its voice ids

    def register(self, voice: VoiceData, client: str = "") -> tuple[str, bool]:
        vid = voice.voice_id
        owned = self._owned.setdefault(client, LRU(self.max_per_client or None))
        created = vid not in owned
        self._owners.setdefault(vid, set()).add(client)
        for old, _ in owned.put(vid):  # past the client's quota: its own oldest goes
            self._disown(old, client)
        for old, _ in self._voices.put(vid, voice):  # past the global bound: the oldest goes
            for owner in list(self._owners.get(old, ())):
                self._disown(old, owner)
        return vid, created

    def _check(self, voice_id: str, client: str) -> None:
        if client not in self._owners.get(voice_id, ()):
            raise NotFound(f"voice_id {voice_id!r} is not registered (by this client)")

    def get(self, voice_id: str, client: str = "") -> VoiceData:
        self._check(voice_id, client)
        self._owned[client].get(voice_id)  # counts as use
        return self._voices.get(voice_id)

    def delete(self, voice_id: str, client: str = "") -> None:
        self._check(voice_id, client)
        self._disown(voice_id, client)

    def _disown(self, voice_id: str, client: str) -> None:
        owned = self._owned.get(client)
        if owned is not None:
            owned.pop(voice_id)
            if not len(owned):
                self._owned.pop(client, None)
        owners = self._owners.get(voice_id, set())
        owners.discard(client)
        if not owners:
            self._owners.pop(voice_id, None)
            self._voices.pop(voice_id)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        flow: FlowClient,
        vocoders: ReplicaSet,
        voices: VoiceRegistry,
        limits: PipelineLimits,
        max_streams: int,
        voice_maker: VoiceMaker | None = None,
        admission: AdmissionConfig = AdmissionConfig(),
        inbound: InboundLimits | None = None,
        per_client: ClientStreams | None = None,
    ):
        self.voice_maker = voice_maker  # None: started without --frontend-dir
        self.flow = flow
        self.vocoder = VocoderClient(vocoders)
        self.voices = voices
        self.limits = limits
        self.max_streams = max_streams
        self.inbound = inbound or InboundLimits()
        self.per_client = per_client or ClientStreams()
        self.num_streams = 0
        self.admission = AdmissionController(admission, flow.board)

    def _setup(self, msg, context, client: str) -> tuple[StreamSetup, OutputSpec]:
        if msg.WhichOneof("message") != "config":
            raise InvalidArgument("config", "the first message must be a StreamConfig")
        cfg = msg.config
        request_id = check_request_id(cfg.request_id or uuid.uuid4().hex, "config.request_id")
        which = cfg.WhichOneof("voice")
        if which == "inline_voice":
            voice = decode_voice(cfg.inline_voice, "config.inline_voice")
        elif which == "voice_id":
            voice = self.voices.get(cfg.voice_id, client)
        else:
            raise InvalidArgument("config.voice", "set inline_voice or voice_id")
        output = check_output(cfg.audio_format, cfg.sample_rate)  # names the bad field
        # Other rates and formats are made from the vocoder's float32 by ClientAudio.
        fmt = output.audio_format if output.is_passthrough else gateway_pb2.AUDIO_FORMAT_FLOAT32
        schedule = ScheduleConfig.from_proto(
            cfg.schedule if cfg.HasField("schedule") else None, self.limits.schedule
        )
        resume = cfg.resume_from_sample
        if resume and not output.is_passthrough:
            raise InvalidArgument(
                "config.resume_from_sample",
                "resume takes PCM16 or FLOAT32 at 24000 Hz only (resampled or encoded output "
                "cannot start mid-stream)",
            )
        if resume > MAX_SAMPLES:
            raise InvalidArgument(
                "config.resume_from_sample", f"{resume} is past the longest stream (300 s)"
            )
        start_buffer = None
        if cfg.HasField("start_buffer_ms"):
            if cfg.start_buffer_ms > MAX_START_BUFFER_MS:
                raise InvalidArgument(
                    "config.start_buffer_ms",
                    f"{cfg.start_buffer_ms} is over the most, {MAX_START_BUFFER_MS} ms",
                )
            start_buffer = cfg.start_buffer_ms / 1e3
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        setup = StreamSetup(request_id, voice, fmt, schedule, deadline, resume, start_buffer)
        return setup, output

    async def Synthesize(self, request_iterator, context):
        inbound = Inbound(request_iterator, self.inbound)
        sent = False
        try:
            async for msg in self._synthesize(inbound, context):
                sent = True
                yield msg
        except Exception as exc:
            # Ending the call while the client still writes lets grpc.aio replace our status
            # with INTERNAL on its side: say the status in the headers, let it finish writing.
            if not sent:
                await announce_status(context, exc)
            await inbound.drain()
            raise
        finally:
            await inbound.close()

    async def _synthesize(self, inbound: Inbound, context):
        try:
            first = await inbound.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument("config", "empty stream: send a StreamConfig first") from None
        client = client_of(context)
        setup, output = self._setup(first, context, client)
        request_id_var.set(setup.request_id)
        if self.num_streams >= self.max_streams:
            raise ResourceExhausted(f"gateway at its limit of {self.max_streams} streams")
        self.per_client.acquire(client)
        try:
            pipeline = StreamPipeline(
                setup, self.flow, self.vocoder, self.limits, self.admission.observe
            )
            await self.admission.admit(pipeline)  # RESOURCE_EXHAUSTED: it would make streams late
        except BaseException:
            self.per_client.release(client)
            raise
        self.num_streams += 1
        metrics.ACTIVE_STREAMS.set(self.num_streams)
        started = time.monotonic()
        client_audio = None if output.is_passthrough else ClientAudio(output)
        try:
            first_chunk = True
            async for msg in pipeline.run(inbound):
                if client_audio is not None:
                    msg = await client_audio.convert(msg)
                tracing.chunk_span(msg)
                if first_chunk:
                    metrics.FIRST_CHUNK.observe(msg.timing.gateway_ms / 1e3)
                    first_chunk = False
                metrics.count_audio(msg.num_samples, msg.sample_rate)
                yield msg
            metrics.STREAMS.labels("ok").inc()
        except BaseException as exc:
            metrics.STREAMS.labels(type(exc).__name__).inc()
            raise
        finally:
            if client_audio is not None:
                client_audio.close()
            await self.admission.release(pipeline)
            self.num_streams -= 1
            self.per_client.release(client)
            metrics.ACTIVE_STREAMS.set(self.num_streams)
            metrics.STREAM_SECONDS.observe(time.monotonic() - started)

    async def RegisterVoice(self, request, context):
        voice, from_audio = await voice_from_request(request, self.voice_maker)
        voice_id, created = self.voices.register(voice, client_of(context))
        return gateway_pb2.RegisterVoiceResponse(
            voice_id=voice_id,
            created=created,
            prompt_token=encode(voice.prompt_token.astype("int32")),
            voice=voice.to_proto() if from_audio else None,
        )

    async def DeleteVoice(self, request, context):
        self.voices.delete(request.voice_id, client_of(context))
        return gateway_pb2.DeleteVoiceResponse()
