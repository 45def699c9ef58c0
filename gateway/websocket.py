"""Synthesize over a WebSocket, for browsers and runtimes without gRPC (`--websocket-port`).

Each socket is one Synthesize stream, relayed to this gateway's own gRPC listener on loopback,
so authentication, limits, admission, deadlines and errors are the gRPC API's own (one caveat:
without --auth-tokens every socket's peer is the relay, 127.0.0.1, so --max-streams-per-client
counts all WebSocket clients as one; with tokens each token is its own client):

1. The client sends one text message, a JSON object: `voice_id` (a registered voice) or
   `voice` (`prompt_token`: [ids], `prompt_feat`: [[80 floats] x 2 x ids], `embedding`:
   [192 floats]); optional `request_id`, `audio_format` ("pcm16" default, "float32", "wav",
   "mulaw", "alaw", "opus_ogg", "opus_packets", "mp3"), `sample_rate` (24000 default),
   `start_buffer_ms` (StreamConfig's; absent: the gateway's --start-buffer-ms), `token` (the
   bearer token when the gateway runs --auth-tokens; an `Authorization: Bearer` header on the
   upgrade request works too).
2. Then tokens: text messages holding a JSON array of ids, or binary messages of
   little-endian int32 ids; then the text message `{"end": true}`.
3. The server sends one binary message per audio chunk: a 24-byte little-endian header
   (uint32 seq, uint64 sample_offset, uint32 num_samples, uint32 sample_rate, uint8 flags with
   bit 0 = final, 3 bytes 0), then the chunk's audio in the stream's format (the gRPC API's
   `audio` bytes). After the final chunk it closes with 1000.
4. An error closes the socket with 4000 + the gRPC status code (4003 INVALID_ARGUMENT, 4005
   NOT_FOUND, 4008 RESOURCE_EXHAUSTED, 4014 UNAVAILABLE, 4016 UNAUTHENTICATED, ...) and the
   status's one-line message as the reason. Closing the socket cancels the stream.

GET / on the same port serves a demo page (gateway/static/demo.html) that streams a sample
utterance and plays it with WebAudio; GET /sample.json is that sample (make-sample's voice and
tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import struct
from pathlib import Path

import grpc
import numpy as np
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from gateway.audio_format import AudioFormat
from token2wav.server import channel_options
from token2wav.tensors import make_voice
from token2wav.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<IQIIB3x")  # seq, sample_offset, num_samples, sample_rate, flags
FLAG_FINAL = 1
CONFIG_TIMEOUT_S = 10.0  # for the first message; a socket that says nothing is closed
MAX_MESSAGE_BYTES = 4 << 20  # an inline voice of a 30 s prompt is ~1 MB as JSON
CLOSE_TIMEOUT_S = 2.0  # a peer that does not answer our close frame is cut after this
CLOSE_ERROR_BASE = 4000  # + grpc.StatusCode's number
CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's reason fits in 123 bytes
STATIC_DIR = Path(__file__).with_name("static")
CONFIG_KEYS = {
    "voice_id",
    "voice",
    "request_id",
    "audio_format",
    "sample_rate",
    "start_buffer_ms",
    "token",
}
FORMAT_NAMES = {f.name.lower(): f for f in AudioFormat}


class BadSocketInput(ValueError):
    """Input the socket sent that never reaches the gRPC API (closed with 4003)."""


def stream_config(obj) -> tuple[gateway_pb2.StreamConfig, str]:
    """(StreamConfig, bearer token or "") from the first message's JSON object."""
    if not isinstance(obj, dict):
        raise BadSocketInput("config: the first message must be a JSON object")
    unknown = sorted(set(obj) - CONFIG_KEYS)
    if unknown:
        raise BadSocketInput(f"config.{unknown[0]}: unknown field")
    cfg = gateway_pb2.StreamConfig(request_id=str(obj.get("request_id", "")))
    if "voice_id" in obj:
        cfg.voice_id = str(obj["voice_id"])
    elif "voice" in obj:
        v = obj["voice"]
        if not isinstance(v, dict) or set(v) != {"prompt_token", "prompt_feat", "embedding"}:
            raise BadSocketInput("config.voice: want prompt_token, prompt_feat and embedding")
        try:
            voice = make_voice(
                np.asarray(v["prompt_token"], dtype=np.int64),
                np.asarray(v["prompt_feat"], dtype=np.float32),
                np.asarray(v["embedding"], dtype=np.float32),
                "config.voice",
            )
        except (TypeError, ValueError) as exc:
            raise BadSocketInput(str(exc).splitlines()[0]) from None
        cfg.inline_voice.CopyFrom(voice.to_proto())
    fmt = obj.get("audio_format", "pcm16")
    if fmt not in FORMAT_NAMES:
        raise BadSocketInput(f"config.audio_format: want one of {', '.join(FORMAT_NAMES)}")
    cfg.audio_format = int(FORMAT_NAMES[fmt])
    rate = obj.get("sample_rate", 0)
    if not isinstance(rate, int) or isinstance(rate, bool) or rate < 0:
        raise BadSocketInput("config.sample_rate: want an integer number of Hz")
    cfg.sample_rate = rate
    if "start_buffer_ms" in obj:  # absent: the gateway's default (the servicer bounds it)
        ms = obj["start_buffer_ms"]
        if not isinstance(ms, int) or isinstance(ms, bool) or not 0 <= ms < 2**32:
            raise BadSocketInput("config.start_buffer_ms: want an integer number of ms >= 0")
        cfg.start_buffer_ms = ms
    token = obj.get("token", "")
    if not isinstance(token, str):
        raise BadSocketInput("config.token: want a string")
    return cfg, token


def request_from(message: str | bytes) -> gateway_pb2.SynthesizeRequest:
    """A token message (JSON array or int32 little-endian bytes) or the end message."""
    if isinstance(message, bytes):
        if len(message) % 4:
            raise BadSocketInput("tokens: binary messages are int32 ids, 4 bytes each")
        ids = np.frombuffer(message, "<i4")
    else:
        try:
            obj = json.loads(message)
        except json.JSONDecodeError:
            raise BadSocketInput("tokens: not JSON") from None
        if obj == {"end": True}:
            return gateway_pb2.SynthesizeRequest(end=gateway_pb2.EndOfInput())
        if not isinstance(obj, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in obj
        ):
            raise BadSocketInput('tokens: want a JSON array of integer ids, or {"end": true}')
        ids = np.asarray(obj, dtype=np.int64)
    if ids.size and ids.min() < 0:
        raise BadSocketInput(f"tokens: id {int(ids.min())} is negative")
    return gateway_pb2.SynthesizeRequest(tokens=gateway_pb2.TokenChunk(tokens=ids.tolist()))


def frame(msg: gateway_pb2.SynthesizeResponse) -> bytes:
    flags = FLAG_FINAL if msg.is_final else 0
    head = HEADER.pack(msg.seq, msg.sample_offset, msg.num_samples, msg.sample_rate, flags)
    return head + msg.audio


def close_reason(text: str) -> str:
    line = (text or "").splitlines()[0] if text else ""
    data = line.encode()[:CLOSE_REASON_BYTES]
    return data.decode(errors="ignore")


class WebSocketBridge:
    """The WebSocket listener on `host`:`port` (0: any free port, then `port` says which)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._channel: grpc.aio.Channel | None = None
        self._server = None
        self._sample: bytes | None = None

    async def start(self, target: str) -> None:
        """Listen; relay each socket's stream to the gateway's gRPC listener at `target`."""
        self._channel = grpc.aio.insecure_channel(target, options=channel_options())
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._server = await serve(
            self._handle,
            self.host,
            self.port,
            max_size=MAX_MESSAGE_BYTES,
            close_timeout=CLOSE_TIMEOUT_S,
            process_request=self._http,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("WebSocket endpoint and demo page on http://%s:%d/", self.host, self.port)

    def stop_accepting(self) -> None:
        """Drain: no new sockets; open ones go on while the gRPC listener lets their streams
        finish (its grace period)."""
        if self._server is not None:
            self._server.close(close_connections=False)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        """Plain GETs: the demo page and its sample; an upgrade goes on to `_handle`."""
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return None
        path = request.path.split("?", 1)[0]
        if path in ("/", "/demo.html"):
            body, kind = (STATIC_DIR / "demo.html").read_bytes(), "text/html; charset=utf-8"
        elif path == "/sample.json":
            body, kind = self._sample_json(), "application/json"
        else:
            return connection.respond(http.HTTPStatus.NOT_FOUND, "not found\n")
        headers = Headers([("Content-Type", kind), ("Content-Length", str(len(body)))])
        return Response(http.HTTPStatus.OK, "OK", headers, body)

    def _sample_json(self) -> bytes:
        if self._sample is None:
            rng = np.random.default_rng(0)  # make-sample's voice and tokens, seed 0
            n_p = 75
            self._sample = json.dumps(
                {
                    "voice": {
                        "prompt_token": rng.integers(0, 6561, n_p).tolist(),
                        "prompt_feat": np.round(rng.standard_normal((2 * n_p, 80)) - 5, 4).tolist(),
                        "embedding": np.round(rng.standard_normal(192), 4).tolist(),
                    },
                    "tokens": rng.integers(0, 6561, 250).tolist(),
                }
            ).encode()
        return self._sample

    async def _handle(self, ws: ServerConnection) -> None:
        try:
            first = await asyncio.wait_for(ws.recv(), CONFIG_TIMEOUT_S)
            if not isinstance(first, str):
                raise BadSocketInput("config: the first message must be JSON text")
            try:
                obj = json.loads(first)
            except json.JSONDecodeError:
                raise BadSocketInput("config: not JSON") from None
            cfg, token = stream_config(obj)
        except BadSocketInput as exc:
            await ws.close(_invalid(), close_reason(str(exc)))
            return
        except (TimeoutError, asyncio.TimeoutError):
            await ws.close(
                CLOSE_ERROR_BASE + grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "no config"
            )
            return
        except ConnectionClosed:
            return
        header = ws.request.headers.get("Authorization", "") if ws.request else ""
        auth = token or _bearer(header)
        metadata = (("authorization", f"Bearer {auth}"),) if auth else ()
        requests: asyncio.Queue = asyncio.Queue(maxsize=64)
        await requests.put(gateway_pb2.SynthesizeRequest(config=cfg))

        async def request_iter():
            while (msg := await requests.get()) is not None:
                yield msg

        call = self._stub.Synthesize(request_iter(), metadata=metadata)
        cancelled: list[BadSocketInput | None] = []  # set when _pump cancelled the call
        pump = asyncio.ensure_future(self._pump(ws, requests, call, cancelled))
        try:
            async for msg in call:
                await ws.send(frame(msg))
            await ws.close(1000, "")
        except asyncio.CancelledError:
            # grpc.aio ends a cancelled call's iteration so; only ours is handled here.
            if not cancelled:
                raise
            if cancelled[0] is not None:
                await ws.close(_invalid(), close_reason(str(cancelled[0])))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                code = CLOSE_ERROR_BASE + exc.code().value[0]
                await ws.close(code, close_reason(exc.details()))
        except ConnectionClosed:
            call.cancel()  # the client left while its audio was being sent
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump

    async def _pump(self, ws: ServerConnection, requests: asyncio.Queue, call, cancelled) -> None:
        """Socket messages -> the gRPC call's requests. A socket closed before its end message,
        or bad input, cancels the call (noted in `cancelled`: None, or the bad input)."""
        try:
            async for message in ws:
                req = request_from(message)
                await requests.put(req)
                if req.WhichOneof("message") == "end":
                    await requests.put(None)
                    return
            cancelled.append(None)
        except ConnectionClosed:
            cancelled.append(None)
        except BadSocketInput as exc:
            cancelled.append(exc)
        call.cancel()


def _invalid() -> int:
    return CLOSE_ERROR_BASE + grpc.StatusCode.INVALID_ARGUMENT.value[0]


def _bearer(header: str) -> str:
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""
