"""gRPC transport for Generate: proto <-> FlowRequest, then await the engine."""

from __future__ import annotations

import math
import time

import torch

from flow_service.engine import FlowEngine
from flow_service.model import FlowRequest, validate_request
from flow_service.voices import VoiceCache
from token2wav import MAX_FRAMES, TOKEN_MEL_RATIO
from token2wav.errors import InvalidArgument, check_request_id
from token2wav.server import request_id_var
from token2wav.tensors import decode_tokens, decode_voice, encode
from token2wav.v1 import common_pb2, flow_pb2, flow_pb2_grpc


class FlowServicer(flow_pb2_grpc.FlowServicer):
    def __init__(self, engine: FlowEngine, voices: VoiceCache):
        self.engine = engine
        self.voices = voices

    def _flow_request(self, request: flow_pb2.GenerateRequest) -> tuple[str, FlowRequest]:
        which = request.WhichOneof("voice")
        if which == "inline_voice":
            voice_id, voice = self.voices.put(decode_voice(request.inline_voice, "inline_voice"))
        elif which == "voice_id":
            voice_id, voice = request.voice_id, self.voices.get(request.voice_id)
        else:
            raise InvalidArgument("voice", "set inline_voice or voice_id")
        tokens = decode_tokens(request.tokens, "tokens", max_len=MAX_FRAMES // TOKEN_MEL_RATIO)
        chunk = FlowRequest(
            voice=voice,
            tokens=torch.from_numpy(tokens),
            token_offset=request.token_offset,
            finalize=request.finalize,
            streaming=request.streaming,
            cache_key=request.request_id,  # the stream: its prefix cache entry (if any)
        )
        validate_request(chunk)
        return voice_id, chunk

    async def Generate(self, request, context):
        request_id_var.set(check_request_id(request.request_id, required=False) or "-")
        voice_id, chunk = self._flow_request(request)
        remaining = context.time_remaining()
        now = time.monotonic()
        deadline = math.inf if remaining is None else now + remaining
        # Slack is relative to the sender's send time: on our clock it starts now (transit
        # unaccounted, see flow.proto).
        due = now + request.slack_ms / 1e3 if request.HasField("slack_ms") else math.inf
        result = await self.engine.submit(chunk, deadline, due)
        return flow_pb2.GenerateResponse(
            mel=encode(result.mel),
            voice_id=voice_id,
            timing=common_pb2.StageTiming(
                queue_ms=result.queue_ms, compute_ms=result.compute_ms, batch_size=result.batch_size
            ),
            padded_frames=result.padded_frames,
            capacity_frames_per_s=self.engine.cost.capacity_frames_per_s,
        )
