"""The public Gateway service: Synthesize streams, RegisterVoice, DeleteVoice."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections import OrderedDict

from gateway import metrics
from gateway.downstream import FlowClient
from gateway.inbound import Inbound, InboundLimits, announce_status
from gateway.pipeline import PipelineLimits, StreamPipeline, StreamSetup
from gateway.routing import ReplicaSet
from gateway.schedule import ScheduleConfig
from token2wav.errors import InvalidArgument, NotFound, ResourceExhausted
from token2wav.server import request_id_var
from token2wav.tensors import VoiceData, decode_voice
from token2wav.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class VoiceRegistry:
    """Registered voices by content-addressed id (LRU, bounded)."""

    def __init__(self, max_voices: int = 1024):
        self.max_voices = max_voices
        self._voices: OrderedDict[str, VoiceData] = OrderedDict()  # voice_id -> voice

    def register(self, voice: VoiceData) -> tuple[str, bool]:
        vid = voice.voice_id
        created = vid not in self._voices
        self._voices[vid] = voice
        self._voices.move_to_end(vid)
        while len(self._voices) > self.max_voices:
            self._voices.popitem(last=False)
        return vid, created

    def get(self, voice_id: str) -> VoiceData:
        voice = self._voices.get(voice_id)
        if voice is None:
            raise NotFound(f"voice_id {voice_id!r} is not registered")
        self._voices.move_to_end(voice_id)
        return voice

    def delete(self, voice_id: str) -> None:
        if self._voices.pop(voice_id, None) is None:
            raise NotFound(f"voice_id {voice_id!r} is not registered")


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        flow: FlowClient,
        vocoders: ReplicaSet,
        voices: VoiceRegistry,
        limits: PipelineLimits,
        max_streams: int,
        inbound: InboundLimits | None = None,
    ):
        self.flow = flow
        self.vocoders = vocoders
        self.voices = voices
        self.limits = limits
        self.max_streams = max_streams
        self.inbound = inbound or InboundLimits()
        self.num_streams = 0

    def _setup(self, msg, context) -> StreamSetup:
        if msg.WhichOneof("message") != "config":
            raise InvalidArgument("config", "the first message must be a StreamConfig")
        cfg = msg.config
        request_id = cfg.request_id or uuid.uuid4().hex
        if not REQUEST_ID.match(request_id):
            raise InvalidArgument("config.request_id", "want 1..128 characters of [A-Za-z0-9._:-]")
        which = cfg.WhichOneof("voice")
        if which == "inline_voice":
            voice = decode_voice(cfg.inline_voice, "config.inline_voice")
        elif which == "voice_id":
            voice = self.voices.get(cfg.voice_id)
        else:
            raise InvalidArgument("config.voice", "set inline_voice or voice_id")
        fmt = cfg.audio_format or gateway_pb2.AUDIO_FORMAT_PCM16
        if fmt not in (gateway_pb2.AUDIO_FORMAT_PCM16, gateway_pb2.AUDIO_FORMAT_FLOAT32):
            raise InvalidArgument("config.audio_format", f"unknown format {fmt}")
        schedule = ScheduleConfig.from_proto(cfg.schedule)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        return StreamSetup(request_id, voice, fmt, schedule, deadline)

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
        setup = self._setup(first, context)
        request_id_var.set(setup.request_id)
        if self.num_streams >= self.max_streams:
            raise ResourceExhausted(f"gateway at its limit of {self.max_streams} streams")
        self.num_streams += 1
        metrics.ACTIVE_STREAMS.set(self.num_streams)
        started = time.monotonic()
        pipeline = StreamPipeline(setup, self.flow, self.vocoders, self.limits)
        try:
            first_chunk = True
            async for msg in pipeline.run(inbound):
                if first_chunk:
                    metrics.FIRST_CHUNK.observe(msg.timing.gateway_ms / 1e3)
                    first_chunk = False
                metrics.AUDIO_SECONDS.inc(msg.num_samples / 24000)
                yield msg
            metrics.STREAMS.labels("ok").inc()
        except BaseException as exc:
            metrics.STREAMS.labels(type(exc).__name__).inc()
            raise
        finally:
            self.num_streams -= 1
            metrics.ACTIVE_STREAMS.set(self.num_streams)
            metrics.STREAM_SECONDS.observe(time.monotonic() - started)

    async def RegisterVoice(self, request, context):
        voice = decode_voice(request.voice, "voice")
        voice_id, created = self.voices.register(voice)
        return gateway_pb2.RegisterVoiceResponse(voice_id=voice_id, created=created)

    async def DeleteVoice(self, request, context):
        self.voices.delete(request.voice_id)
        return gateway_pb2.DeleteVoiceResponse()
