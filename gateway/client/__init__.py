"""Client library and CLI for the token2wav gateway.

Async:
    async with AsyncClient("127.0.0.1:50051") as client:
        stream = client.stream(voice)                # VoiceData or a registered voice id
        await stream.send(tokens[:40]); await stream.send(tokens[40:]); await stream.end()
        async for chunk in stream:                   # AudioChunk(seq, sample_offset, samples, ...)
            play(chunk.samples)
Sync:
    with Client("127.0.0.1:50051") as client:
        audio = client.synthesize(voice, tokens)      # np.float32 at 24 kHz
CLI:
    python -m gateway.client synthesize --voice v.npz --tokens t.npy --out out.wav
    python -m gateway.client synthesize --voice v.npz --tokens t.npy --out out.opus \
        --sample-rate 48000                          # Opus in Ogg; .wav: 16-bit PCM
    python -m gateway.client synthesize --audio prompt.wav --tokens t.npy --out out.wav
    python -m gateway.client make-sample --out-dir out/sample
    python -m gateway.client make-voice --audio prompt.wav --frontend-dir DIR --out voice.npz
    python -m gateway.client import-speakers spk2info.pt --out-dir voices/
    python -m gateway.client export-speakers --out spk2info.pt alice=voices/alice.npz
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import uuid
import wave
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from gateway.audio_format import AudioFormat
from gateway.schedule import LOOKAHEAD_TOKENS, ChunkPlanner, ScheduleConfig
from token2wav import MAX_FRAMES, SAMPLE_RATE, SAMPLES_PER_TOKEN, TOKEN_MEL_RATIO, VOCAB_SIZE
from token2wav.errors import DETAILS_KEY, STATUS_KEY, InvalidArgument
from token2wav.security import channel_credentials
from token2wav.server import RECONNECT_OPTIONS, channel_options
from token2wav.tensors import (
    INT_DTYPES,
    VoiceData,
    check_token_ids,
    decode,
    decode_voice,
    encode,
    make_voice,
)
from token2wav.v1 import gateway_pb2, gateway_pb2_grpc

# Wire formats by name (gateway/audio_format.py): "pcm16", "float32", "wav", "mulaw", ...
FORMATS = {f.name.lower(): int(f) for f in AudioFormat}
OPUS_FILE_SUFFIXES = (".ogg", ".opus")
ENCODED_FILES = {".ogg": "opus_ogg", ".opus": "opus_ogg", ".mp3": "mp3"}  # suffix -> format


@dataclass
class AudioChunk:
    seq: int
    sample_offset: int  # at sample_rate
    samples: np.ndarray  # float32 in [-1, 1); empty for Opus (decode `audio`)
    is_final: bool
    timing: gateway_pb2.ChunkTiming
    received_at: float  # time.perf_counter() when it arrived
    num_samples: int = 0  # samples this chunk adds to the stream, at sample_rate
    sample_rate: int = SAMPLE_RATE
    audio: bytes = b""  # the wire's bytes in the stream's format (Opus pages or packets)


def token_ids(tokens, field: str = "tokens") -> np.ndarray:
    """`tokens` as a flat int64 array of speech token ids, each in 0..VOCAB_SIZE-1, or an
    InvalidArgument (a ValueError) naming `field` and the first bad value: floats (1.7 would
    truncate to 1, NaN has no id), negatives, ids past the vocabulary (or past 2^32, which a
    uint32 would truncate) are refused here, before anything is sent."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind == "O":  # Python ints too big for int64, or mixed objects
        flat = arr.reshape(-1)
        for i, t in enumerate(flat):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise InvalidArgument(f"{field}[{i}]", f"{t!r} is not an integer token id")
            if not 0 <= t < VOCAB_SIZE:
                raise InvalidArgument(f"{field}[{i}]", f"id {t} outside 0..{VOCAB_SIZE - 1}")
        return flat.astype(np.int64)
    if arr.dtype.kind not in "iu":
        what = f"{arr.dtype} values"
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            what += (
                f" (non-finite at index {int(np.flatnonzero(~np.isfinite(arr.reshape(-1)))[0])})"
            )
        raise InvalidArgument(
            field, f"{what}; token ids must be integers (an int32 or int64 array)"
        )
    return check_token_ids(arr.reshape(-1), field)


# How .npy files and .npz archives (zip) begin; np.load reads anything else as a pickle.
NUMPY_MAGICS = (b"\x93NUMPY", b"PK\x03\x04", b"PK\x05\x06")


def _load_npy(path: str | Path, what: str):
    """np.load without pickles; a file that is not what `what` says is one ValueError line."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except IsADirectoryError:
        raise ValueError(f"{path}: a directory; want {what}") from None
    if not head.startswith(NUMPY_MAGICS):
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        kind = "an empty file" if not head else "a text file" if text.strip() else "not NumPy data"
        raise ValueError(f"{path}: {kind}; want {what} (written by numpy.save / numpy.savez)")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, EOFError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{path}: cannot read ({exc}); want {what}") from None
    except ValueError as exc:  # numpy's text may advise unpickling: never repeated here
        why = "pickled data, never loaded" if "pickle" in str(exc) else "unreadable"
        raise ValueError(f"{path}: not {what} ({why})") from None


def load_tokens(path: str | Path) -> np.ndarray:
    """A .npy of integer speech token ids (any shape, flattened), validated by `token_ids`."""
    data = _load_npy(path, "an .npy array of token ids")
    if not isinstance(data, np.ndarray):
        data.close()
        raise ValueError(f"{path}: an .npz archive; --tokens wants one .npy array of token ids")
    ids = token_ids(data, Path(path).name)
    if ids.size == 0:
        raise ValueError(f"{path}: no tokens")
    return ids


def load_voice(path: str | Path) -> VoiceData:
    """An .npz with prompt_token int (N,), prompt_feat float32 (2N, 80), embedding float32 (192,)."""
    data = _load_npy(path, "an .npz voice file")
    if isinstance(data, np.ndarray):
        raise ValueError(f"{path}: one .npy array; a voice is an .npz with {sorted(VOICE_ARRAYS)}")
    with data:
        missing = VOICE_ARRAYS - set(data.files)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)}")
        try:
            arrays = [data[name] for name in ("prompt_token", "prompt_feat", "embedding")]
        except ValueError as exc:  # object arrays need pickles, which are never loaded
            raise ValueError(f"{path}: {(str(exc).splitlines() or [''])[0]}") from None
    return make_voice(*arrays, field=Path(path).name)


VOICE_ARRAYS = {"prompt_token", "prompt_feat", "embedding"}


@dataclass
class RegisteredVoice:
    voice_id: str
    prompt_token: np.ndarray  # [N] int32: the LLM's speech prompt
    voice: VoiceData | None  # the voice the gateway made (None when you sent the arrays)


def audio_request(
    audio_file: bytes | None = None, pcm: np.ndarray | None = None, sample_rate: int = 0
) -> gateway_pb2.RegisterVoiceRequest:
    """RegisterVoice from a WAV/FLAC/OGG file's bytes, or PCM (int16 or float32, (n,) or
    (n, channels)) with its sample rate."""
    if (audio_file is None) == (pcm is None):
        raise ValueError("give either audio_file bytes or pcm samples")
    if audio_file is not None:
        return gateway_pb2.RegisterVoiceRequest(audio_file=audio_file)
    pcm = np.asarray(pcm)
    if pcm.dtype != np.int16:
        pcm = pcm.astype(np.float32)
    samples = gateway_pb2.PcmAudio(samples=encode(pcm), sample_rate=int(sample_rate))
    return gateway_pb2.RegisterVoiceRequest(audio_pcm=samples)


def _registered(resp: gateway_pb2.RegisterVoiceResponse) -> RegisteredVoice:
    tokens = decode(resp.prompt_token, "prompt_token", dtypes=INT_DTYPES, required=False)
    voice = decode_voice(resp.voice) if resp.HasField("voice") else None
    return RegisteredVoice(resp.voice_id, tokens.astype(np.int32), voice)


def decode_audio(msg: gateway_pb2.SynthesizeResponse) -> np.ndarray:
    """The chunk's samples as float32; empty for Opus, whose packets need the stream's decoder."""
    fmt = msg.audio_format
    if fmt == gateway_pb2.AUDIO_FORMAT_FLOAT32:
        return np.frombuffer(msg.audio, "<f4").astype(np.float32)
    if fmt in (gateway_pb2.AUDIO_FORMAT_MULAW, gateway_pb2.AUDIO_FORMAT_ALAW):
        return g711_decode(msg.audio, fmt == gateway_pb2.AUDIO_FORMAT_MULAW)
    if fmt in (
        gateway_pb2.AUDIO_FORMAT_OPUS_OGG,
        gateway_pb2.AUDIO_FORMAT_OPUS_PACKETS,
        gateway_pb2.AUDIO_FORMAT_MP3,
    ):
        return np.zeros(0, np.float32)
    pcm = msg.audio
    if fmt == gateway_pb2.AUDIO_FORMAT_WAV and msg.seq == 0:
        pcm = pcm[WAV_HEADER_BYTES:]
    return np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0


WAV_HEADER_BYTES = 44


def g711_decode(data: bytes, mulaw: bool) -> np.ndarray:
    """G.711 bytes -> float32, by FFmpeg's decoder (the gateway encodes with FFmpeg's too)."""
    if not data:
        return np.zeros(0, np.float32)
    import av  # only G.711 and Opus users need FFmpeg on the client side

    dec = av.codec.CodecContext.create("pcm_mulaw" if mulaw else "pcm_alaw", "r")
    dec.sample_rate, dec.layout = 8000, "mono"
    frames = dec.decode(av.Packet(data))
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32) / 32768


def audio_chunk(msg: gateway_pb2.SynthesizeResponse) -> AudioChunk:
    return AudioChunk(
        msg.seq,
        msg.sample_offset,
        decode_audio(msg),
        msg.is_final,
        msg.timing,
        time.perf_counter(),
        msg.num_samples,
        msg.sample_rate,
        msg.audio,
    )


def _config(
    voice: VoiceData | str,
    audio_format: str,
    request_id: str,
    schedule: gateway_pb2.ChunkSchedule | None,
    sample_rate: int = 0,
    start_buffer_ms: int | None = None,
) -> gateway_pb2.SynthesizeRequest:
    cfg = gateway_pb2.StreamConfig(
        request_id=request_id, audio_format=FORMATS[audio_format], sample_rate=sample_rate
    )
    if start_buffer_ms is not None:  # None: the gateway's --start-buffer-ms
        cfg.start_buffer_ms = start_buffer_ms
    if isinstance(voice, str):
        cfg.voice_id = voice
    else:
        cfg.inline_voice.CopyFrom(voice.to_proto())
    if schedule is not None:
        cfg.schedule.CopyFrom(schedule)
    return gateway_pb2.SynthesizeRequest(config=cfg)


_CORE_WRITE_ERROR = "Internal error from Core"

DEFAULT_MAX_MESSAGE_MB = 8  # the gateway's --max-message-mb default


class _Outgoing:
    """What a stream checks before it writes: a message the gateway must refuse for its size
    never leaves the client. grpc.aio loses the status of a call the server ends while one of
    our writes is in flight (grpc/grpc#36066), and a message over the server's cap is refused
    by its transport mid-write, before any handler can repeat the status in headers; so the
    client would see only `Internal error from Core`, which `honest_error` can only call a
    retryable ABORTED. Refused here instead: InvalidArgument, every time. The token limit is
    the protocol's (prompt + target at most 300 s), so no legal token message comes near a cap
    (7,500 ids are under 16 kB); the config carries the voice, checked against the cap."""

    def __init__(self, voice, max_message_mb: int):
        prompt = 0 if isinstance(voice, str) else voice.num_prompt_tokens  # by id: unknown here
        self.max_tokens = MAX_FRAMES // TOKEN_MEL_RATIO - prompt
        self.max_bytes = max_message_mb << 20
        self.num_tokens = 0

    def config(self, msg: gateway_pb2.SynthesizeRequest) -> gateway_pb2.SynthesizeRequest:
        size = msg.ByteSize()
        if size > self.max_bytes:
            raise InvalidArgument(
                "config",
                f"{size} bytes, over the gateway's message cap of {self.max_bytes >> 20} MiB "
                "(max_message_mb)",
            )
        return msg

    def tokens(self, ids: list[int]) -> gateway_pb2.SynthesizeRequest:
        total = self.num_tokens + len(ids)
        if total > self.max_tokens:
            raise InvalidArgument(
                "tokens",
                f"{total} tokens in this stream, more than {self.max_tokens}: prompt + target "
                "would exceed 300 s",
            )
        self.num_tokens = total
        return gateway_pb2.SynthesizeRequest(tokens=gateway_pb2.TokenChunk(tokens=ids))


def honest_error(exc: grpc.RpcError) -> grpc.RpcError:
    """The server's status for an error that grpc.aio replaced with `INTERNAL: Internal error
    from Core` (grpc/grpc#36066: the server ended the call while a write of ours was in flight).

    The gateway repeats a refusal's status in its initial metadata; without it (the stream had
    already sent audio) the call ended early for a reason we cannot know: ABORTED, retry."""
    if exc.code() != grpc.StatusCode.INTERNAL or exc.details() != _CORE_WRITE_ERROR:
        return exc
    initial = exc.initial_metadata() or ()
    headers = {str(k): str(v) for k, v in initial}
    code = getattr(grpc.StatusCode, headers.get(STATUS_KEY, ""), None)
    if code is None:
        code = grpc.StatusCode.ABORTED
        details = "the server ended the stream while the client was still sending; retry"
    else:
        details = headers.get(DETAILS_KEY, "")
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(*initial), grpc.aio.Metadata(), details, exc.debug_error_string()
    )


def _open_channel(grpc_api, target: str, tls_ca, token, server_name):
    """(channel, call metadata) for a gateway connection; `grpc_api` is grpc or grpc.aio."""
    options = channel_options() + RECONNECT_OPTIONS
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    if not tls_ca:
        return grpc_api.insecure_channel(target, options=options), metadata
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc_api.secure_channel(target, channel_credentials(tls_ca), options=options), metadata


def _wire_ids(tokens: Iterable[int]) -> list[int]:
    return token_ids(tokens if isinstance(tokens, np.ndarray) else list(tokens)).tolist()


class _StreamState:
    """What AsyncStream and Stream (its sync twin) keep for a resume, and their shared steps."""

    def __init__(
        self,
        stub,
        voice,
        audio_format="float32",
        request_id="",
        schedule=None,
        timeout=None,
        metadata=(),
        max_message_mb=DEFAULT_MAX_MESSAGE_MB,
        sample_rate=0,
        start_buffer_ms=None,
        stubs=None,
        resume_attempts=3,
        resume_within_s=30.0,
        on_move=None,
    ):
        self._out = _Outgoing(voice, max_message_mb)
        can_resume = _can_resume(audio_format, sample_rate)
        # the resumed stream must carry the same id; the gateway would make a new one
        request_id = request_id or (uuid.uuid4().hex if can_resume else "")
        self._config = self._out.config(
            _config(voice, audio_format, request_id, schedule, sample_rate, start_buffer_ms)
        )
        self._stubs = stubs or [stub]
        self._target = self._stubs.index(stub) if stub in self._stubs else 0
        self._resume_attempts = resume_attempts if can_resume else 0
        self._resume_within_s = resume_within_s
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._metadata = metadata
        self._sent: list[gateway_pb2.SynthesizeRequest] = []  # every token message, for a resume
        self._ended = False
        self._cancelled = False
        self._received = 0  # samples the user has been given
        self.num_resumes = 0
        self._on_move = on_move  # told the target index a stream resumed on
        self._start()

    def _start(self) -> None:
        """The twin's own set-up (its request queue), then its first call."""
        raise NotImplementedError

    def _call_timeout(self) -> float | None:
        """What is left of the stream's deadline, for a call opened now."""
        return None if self._deadline is None else max(0.001, self._deadline - time.monotonic())

    def _move_on(self) -> gateway_pb2.SynthesizeRequest:
        """Count a resume, take the next target, and give the config the resumed call opens
        with."""
        self.num_resumes += 1
        self._target = (self._target + 1) % len(self._stubs)
        if self._on_move is not None:
            self._on_move(self._target)
        return _resume_config(self._config, self._received)


class AsyncStream(_StreamState):
    """One Synthesize stream. Send tokens as they come, then `end()`; iterate the audio.

    Resume: when its gateway goes away (UNAVAILABLE, a CANCELLED it did not ask for, or the
    transport breaks), the stream opens itself again on the client's next target with
    StreamConfig.resume_from_sample = the samples received, the tokens sent so far and end() if
    it was called; iteration yields every sample once across it. At most `resume_attempts`
    times, and not past `resume_within_s` seconds after the first loss. PCM16/FLOAT32 at 24 kHz
    only (other outputs end with the error, as before). The resumed audio is recomputed: equal
    to the lost stream's within fp32 rounding."""

    def _start(self) -> None:
        self._requests: asyncio.Queue | None = None
        self._open(self._config)

    def _open(self, config: gateway_pb2.SynthesizeRequest) -> None:
        self._end_requests()
        self._requests = asyncio.Queue()  # one per call: a lost call keeps its own
        for msg in (config, *self._sent):
            self._requests.put_nowait(msg)
        if self._ended:
            self._requests.put_nowait(_END)
            self._requests.put_nowait(None)
        self._call = self._stubs[self._target].Synthesize(
            self._iter_requests(self._requests),
            timeout=self._call_timeout(),
            metadata=self._metadata,
        )

    def _end_requests(self) -> None:
        """End the current call's request iterator: gRPC's task that writes it would otherwise
        wait on the queue for as long as the stream object lives, after the call is gone."""
        if self._requests is not None:
            self._requests.put_nowait(None)

    @staticmethod
    async def _iter_requests(requests: asyncio.Queue):
        while True:
            msg = await requests.get()
            if msg is None:
                return
            yield msg

    async def send(self, tokens: Iterable[int]) -> None:
        """Queue token ids. A bad id, or more tokens than a stream can have, raises
        InvalidArgument here and sends nothing; the stream stays open (send good ids, or
        cancel())."""
        ids = _wire_ids(tokens)
        if ids:
            msg = self._out.tokens(ids)
            if self._resume_attempts:
                self._sent.append(msg)
            self._requests.put_nowait(msg)

    async def end(self) -> None:
        self._ended = True
        self._requests.put_nowait(_END)
        self._requests.put_nowait(None)

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        first_loss = None
        while True:
            try:
                async for msg in self._call:
                    self._received = msg.sample_offset + msg.num_samples
                    yield audio_chunk(msg)
                return
            except grpc.RpcError as exc:
                lost = honest_error(exc)
                if not _should_resume(self, exc, first_loss):
                    self._end_requests()
                    raise lost from None
            first_loss = first_loss or time.monotonic()
            await asyncio.sleep(_resume_pause(self.num_resumes))
            if self._cancelled:  # by the user during the pause
                self._end_requests()
                raise lost
            self._open(self._move_on())


_END = gateway_pb2.SynthesizeRequest(end=gateway_pb2.EndOfInput())


def _can_resume(audio_format: str, sample_rate: int) -> bool:
    """The outputs a gateway can resume (StreamConfig.resume_from_sample)."""
    return audio_format in ("pcm16", "float32") and sample_rate in (0, SAMPLE_RATE)


def _check_resume_bounds(attempts: int, within_s: float) -> None:
    if attempts < 0 or within_s < 0:
        raise ValueError("resume_attempts, resume_within_s: want >= 0")


def _should_resume(stream, exc: grpc.RpcError, first_loss: float | None) -> bool:
    """Whether a stream (sync or async) resumes after `exc`, its current call's raw error:
    its gateway went away and the stream is within its bounds."""
    now = time.monotonic()
    if stream._cancelled or stream.num_resumes >= stream._resume_attempts:
        return False
    if first_loss is not None and now - first_loss > stream._resume_within_s:
        return False
    if stream._deadline is not None and now >= stream._deadline:
        return False
    # CANCELLED that this client did not ask for (checked above): the gateway shut down under
    # the call (a call that reached it as it began to drain), as the gateway itself reads a
    # replica's CANCELLED.
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return True
    # The transport broke under a write of ours and no status came from the gateway.
    return honest_error(exc) is not exc and not _server_status(exc)


def _resume_pause(num_resumes: int) -> float:
    """Seconds before a resume: a gateway restarting in place gets a moment, growing."""
    return min(1.0, 0.05 * 2**num_resumes)


def _resume_config(config: gateway_pb2.SynthesizeRequest, received: int):
    msg = gateway_pb2.SynthesizeRequest()
    msg.CopyFrom(config)
    msg.config.resume_from_sample = received
    return msg


def _server_status(exc: grpc.RpcError) -> bool:
    """Whether the gateway stated a status for this call in its headers."""
    return any(str(k) == STATUS_KEY for k, _ in (exc.initial_metadata() or ()))


def split_targets(target: str | Iterable[str]) -> list[str]:
    """Gateway addresses from one address, a comma-separated list or a list of them."""
    parts = target.split(",") if isinstance(target, str) else list(target)
    targets = [t.strip() for t in parts if t.strip()]
    if not targets:
        raise ValueError("target: no gateway address given")
    return targets


class _Targets:
    """What AsyncClient and Client (its sync twin) share: the channels to the gateways, where
    new streams start, and the streams' resume bounds."""

    _grpc: Any  # grpc.aio or grpc
    _stream: type  # AsyncStream or Stream

    def __init__(
        self,
        target: str | Iterable[str] = "127.0.0.1:50051",
        *,
        tls_ca: str | None = None,
        token: str | None = None,
        server_name: str | None = None,
        max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
        resume_attempts: int = 3,
        resume_within_s: float = 30.0,
    ):
        _check_resume_bounds(resume_attempts, resume_within_s)
        self.channels = []
        for t in split_targets(target):
            channel, self.metadata = _open_channel(self._grpc, t, tls_ca, token, server_name)
            self.channels.append(channel)
        self.stubs = [gateway_pb2_grpc.GatewayStub(c) for c in self.channels]
        self.channel, self.stub = self.channels[0], self.stubs[0]  # calls other than streams
        self.max_message_mb = max_message_mb
        self.resume_attempts = resume_attempts
        self.resume_within_s = resume_within_s
        self.preferred = 0  # the target new streams start on: where the last resume went

    def _moved(self, target: int) -> None:
        self.preferred = target

    def stream(self, voice: VoiceData | str, **kw):
        """A new stream (AsyncStream or Stream) on the preferred target."""
        kw.setdefault("max_message_mb", self.max_message_mb)
        kw.setdefault("resume_attempts", self.resume_attempts)
        kw.setdefault("resume_within_s", self.resume_within_s)
        return self._stream(
            self.stubs[self.preferred],
            voice,
            metadata=self.metadata,
            stubs=self.stubs,
            on_move=self._moved,
            **kw,
        )


class AsyncClient(_Targets):
    """`target`: a gateway address, or several (a list, or comma-separated): streams start on
    the first that last worked and resume on the next (see AsyncStream; with one target, on it
    again, which serves a gateway restarted in place); `resume_attempts` (0: never resume) and
    `resume_within_s` bound each stream's resumes. `tls_ca`: verify the gateway's TLS
    certificate with this CA file (None: plaintext); `token`: bearer token for a gateway run
    with --auth-tokens; `server_name`: the name in the gateway's certificate when `target` is an
    IP; `max_message_mb`: the gateway's --max-message-mb (a stream's config over it is refused
    here, see `_Outgoing`). Voices registered by id live on one gateway: a stream that must
    resume elsewhere should carry its voice inline (or register it on every gateway)."""

    _grpc, _stream = grpc.aio, AsyncStream

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        for channel in self.channels:
            await channel.close()

    async def register_voice(self, voice: VoiceData) -> str:
        resp = await self.stub.RegisterVoice(
            gateway_pb2.RegisterVoiceRequest(voice=voice.to_proto()), metadata=self.metadata
        )
        return resp.voice_id

    async def register_audio(self, audio_file=None, pcm=None, sample_rate=0) -> RegisteredVoice:
        """Have the gateway make a voice from a recording (see `audio_request`)."""
        return _registered(
            await self.stub.RegisterVoice(audio_request(audio_file, pcm, sample_rate))
        )

    async def delete_voice(self, voice_id: str) -> None:
        await self.stub.DeleteVoice(
            gateway_pb2.DeleteVoiceRequest(voice_id=voice_id), metadata=self.metadata
        )


class Stream(_StreamState):
    """The synchronous twin of AsyncStream, resume included (gRPC reads the request queue on
    its own thread)."""

    def _start(self) -> None:
        self._lock = threading.Lock()  # send() from one thread, a resume on the iterating one
        self._requests: queue.Queue = queue.Queue()
        self._open(self._config)

    def _open(self, config: gateway_pb2.SynthesizeRequest) -> None:
        with self._lock:
            self._requests.put(None)  # ends a lost call's request iterator (its sender thread)
            self._requests = queue.Queue()
            for msg in (config, *self._sent):
                self._requests.put(msg)
            if self._ended:
                self._requests.put(_END)
                self._requests.put(None)
            self._call = self._stubs[self._target].Synthesize(
                iter(self._requests.get, None),
                timeout=self._call_timeout(),
                metadata=self._metadata,
            )

    def send(self, tokens: Iterable[int]) -> None:
        """Queue token ids. A bad id, or more tokens than a stream can have, raises
        InvalidArgument here and sends nothing; the stream stays open (send good ids, or
        cancel())."""
        ids = _wire_ids(tokens)
        if ids:
            with self._lock:
                msg = self._out.tokens(ids)
                if self._resume_attempts:
                    self._sent.append(msg)
                self._requests.put(msg)

    def end(self) -> None:
        with self._lock:
            self._ended = True
            self._requests.put(_END)
            self._requests.put(None)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            self._call.cancel()
            self._requests.put(None)  # ends the request iterator gRPC's sender thread waits on

    def __iter__(self) -> Iterator[AudioChunk]:
        first_loss = None
        while True:
            try:
                for msg in self._call:
                    self._received = msg.sample_offset + msg.num_samples
                    yield audio_chunk(msg)
                return
            except grpc.RpcError as exc:
                lost = honest_error(exc)
                if not _should_resume(self, exc, first_loss):
                    with self._lock:
                        self._requests.put(None)  # frees gRPC's sender thread of the lost call
                    raise lost from None
            first_loss = first_loss or time.monotonic()
            time.sleep(_resume_pause(self.num_resumes))
            if self._cancelled:  # by the user during the pause
                raise lost
            self._open(self._move_on())


class Client(_Targets):
    """The synchronous twin of AsyncClient (same arguments)."""

    _grpc, _stream = grpc, Stream

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for channel in self.channels:
            channel.close()

    def register_voice(self, voice: VoiceData) -> str:
        return self.stub.RegisterVoice(
            gateway_pb2.RegisterVoiceRequest(voice=voice.to_proto()), metadata=self.metadata
        ).voice_id

    def register_audio(self, audio_file=None, pcm=None, sample_rate=0) -> RegisteredVoice:
        return _registered(self.stub.RegisterVoice(audio_request(audio_file, pcm, sample_rate)))

    def delete_voice(self, voice_id: str) -> None:
        self.stub.DeleteVoice(
            gateway_pb2.DeleteVoiceRequest(voice_id=voice_id), metadata=self.metadata
        )

    def synthesize(self, voice: VoiceData | str, tokens, **kw) -> np.ndarray:
        tokens = token_ids(tokens)  # bad ids raise here, before a stream is opened
        stream = self.stream(voice, **kw)
        stream.send(tokens)
        stream.end()
        return np.concatenate([c.samples for c in stream] or [np.zeros(0, np.float32)])


# -- CLI -------------------------------------------------------------------------------------


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    pcm = np.clip(np.round(samples * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())


def make_sample(out_dir: str | Path, prompt_tokens: int = 75, tokens: int = 250, seed: int = 0):
    """A random voice and token sequence (random weights make noise-like audio anyway)."""
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(
        out / "voice.npz",
        prompt_token=rng.integers(0, VOCAB_SIZE, prompt_tokens).astype(np.int32),
        prompt_feat=(rng.standard_normal((2 * prompt_tokens, 80)) - 5).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
    )
    np.save(out / "tokens.npy", rng.integers(0, VOCAB_SIZE, tokens).astype(np.int32))
    return out / "voice.npz", out / "tokens.npy"


def run_synthesis(
    target: str,
    voice: VoiceData,
    tokens: np.ndarray,
    out: str | None,
    pace: float = 0.0,
    audio_format: str = "pcm16",
    progress: bool = True,
    timeout: float | None = None,
    sample_rate: int = SAMPLE_RATE,
) -> dict:
    """Stream tokens (all at once, or `pace` tokens/s), collect audio; returns the figures.
    `out` ending in .ogg or .opus asks for Opus in Ogg, .mp3 for MP3, and writes the bytes as
    they come; anything else is a WAV file of 16-bit PCM (`audio_format` is then the wire's PCM16 or
    FLOAT32)."""
    planner = ChunkPlanner(voice.num_prompt_tokens, ScheduleConfig())
    first_needed = min(len(tokens), planner.first_hop + LOOKAHEAD_TOKENS)
    encoded = ENCODED_FILES.get(Path(out).suffix.lower()) if out is not None else None
    if encoded:
        audio_format = encoded
    with Client(target) as client:
        stream = client.stream(
            voice, audio_format=audio_format, timeout=timeout, sample_rate=sample_rate
        )
        t0 = time.perf_counter()
        first_tokens_sent = [t0]
        stop = threading.Event()  # set when the main thread is done: the feeder must not linger
        feed_error: list[BaseException] = []

        def feed():
            try:
                if pace <= 0:
                    stream.send(tokens)
                else:
                    for i, tok in enumerate(tokens):
                        if stop.wait(max(0.0, t0 + i / pace - time.perf_counter())):
                            return
                        stream.send([tok])
                        if i + 1 == first_needed:
                            first_tokens_sent[0] = time.perf_counter()
                stream.end()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                feed_error.append(exc)
                stream.cancel()  # the gateway drops the stream; the loop below wakes up

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        chunks = []
        expected = SAMPLES_PER_TOKEN * len(tokens) * sample_rate // SAMPLE_RATE
        try:
            for chunk in stream:
                chunks.append(chunk)
                if progress:
                    got = chunk.sample_offset + chunk.num_samples
                    bar = "#" * int(30 * got / max(1, expected))
                    print(
                        f"\r[{bar:<30}] {got / sample_rate:6.2f}/{expected / sample_rate:.2f} s "
                        f"chunk {chunk.seq}",
                        end="",
                        file=sys.stderr,
                        flush=True,
                    )
        except grpc.RpcError:
            if feed_error:  # the cancel was ours: the feeder's error is the story
                raise feed_error[0] from None
            raise
        finally:
            stop.set()
            if feeder.is_alive():  # the call failed while tokens were still going out
                stream.cancel()
            feeder.join()
            if progress and chunks:
                print(file=sys.stderr)
        if feed_error:
            raise feed_error[0]
        wall = time.perf_counter() - t0
    num_samples = sum(c.num_samples for c in chunks)
    if out and encoded:
        Path(out).write_bytes(b"".join(c.audio for c in chunks))
    elif out:
        write_wav(out, np.concatenate([c.samples for c in chunks]), sample_rate)
    seconds = num_samples / sample_rate
    return {
        "chunks": len(chunks),
        "audio_seconds": seconds,
        "wall_seconds": wall,
        "first_chunk_ms": (chunks[0].received_at - first_tokens_sent[0]) * 1e3,
        "rtf": wall / seconds,
        "xrt": seconds / wall,
        "samples": num_samples,
    }
