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
    python -m gateway.client make-sample --out-dir sample/
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import sys
import threading
import time
import wave
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from gateway.schedule import LOOKAHEAD_TOKENS, ChunkPlanner, ScheduleConfig
from token2wav import SAMPLE_RATE, SAMPLES_PER_TOKEN
from token2wav.errors import DETAILS_KEY, STATUS_KEY
from token2wav.security import channel_credentials
from token2wav.server import channel_options
from token2wav.tensors import VoiceData, make_voice
from token2wav.v1 import gateway_pb2, gateway_pb2_grpc

FORMATS = {"pcm16": gateway_pb2.AUDIO_FORMAT_PCM16, "float32": gateway_pb2.AUDIO_FORMAT_FLOAT32}


@dataclass
class AudioChunk:
    seq: int
    sample_offset: int
    samples: np.ndarray  # float32 in [-1, 1)
    is_final: bool
    timing: gateway_pb2.ChunkTiming
    received_at: float  # time.perf_counter() when it arrived


def load_voice(path: str | Path) -> VoiceData:
    """An .npz with prompt_token int (N,), prompt_feat float32 (2N, 80), embedding float32 (192,)."""
    with np.load(path) as data:
        missing = {"prompt_token", "prompt_feat", "embedding"} - set(data.files)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)}")
        return make_voice(
            data["prompt_token"], data["prompt_feat"], data["embedding"], field=Path(path).name
        )


def decode_audio(msg: gateway_pb2.SynthesizeResponse) -> np.ndarray:
    if msg.audio_format == gateway_pb2.AUDIO_FORMAT_FLOAT32:
        return np.frombuffer(msg.audio, "<f4").astype(np.float32)
    return np.frombuffer(msg.audio, "<i2").astype(np.float32) / 32768.0


def audio_chunk(msg: gateway_pb2.SynthesizeResponse) -> AudioChunk:
    return AudioChunk(
        msg.seq, msg.sample_offset, decode_audio(msg), msg.is_final, msg.timing, time.perf_counter()
    )


def _config(
    voice: VoiceData | str,
    audio_format: str,
    request_id: str,
    schedule: gateway_pb2.ChunkSchedule | None,
) -> gateway_pb2.SynthesizeRequest:
    cfg = gateway_pb2.StreamConfig(request_id=request_id, audio_format=FORMATS[audio_format])
    if isinstance(voice, str):
        cfg.voice_id = voice
    else:
        cfg.inline_voice.CopyFrom(voice.to_proto())
    if schedule is not None:
        cfg.schedule.CopyFrom(schedule)
    return gateway_pb2.SynthesizeRequest(config=cfg)


_CORE_WRITE_ERROR = "Internal error from Core"


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
    options = channel_options()
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    if not tls_ca:
        return grpc_api.insecure_channel(target, options=options), metadata
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc_api.secure_channel(target, channel_credentials(tls_ca), options=options), metadata


class AsyncStream:
    """One Synthesize stream. Send tokens as they come, then `end()`; iterate the audio."""

    def __init__(
        self,
        stub,
        voice,
        audio_format="float32",
        request_id="",
        schedule=None,
        timeout=None,
        metadata=(),
    ):
        self._requests: asyncio.Queue = asyncio.Queue()
        self._requests.put_nowait(_config(voice, audio_format, request_id, schedule))
        self._call = stub.Synthesize(self._iter_requests(), timeout=timeout, metadata=metadata)

    async def _iter_requests(self):
        while True:
            msg = await self._requests.get()
            if msg is None:
                return
            yield msg

    async def send(self, tokens: Iterable[int]) -> None:
        ids = [int(t) for t in tokens]
        if ids:
            self._requests.put_nowait(
                gateway_pb2.SynthesizeRequest(tokens=gateway_pb2.TokenChunk(tokens=ids))
            )

    async def end(self) -> None:
        self._requests.put_nowait(gateway_pb2.SynthesizeRequest(end=gateway_pb2.EndOfInput()))
        self._requests.put_nowait(None)

    def cancel(self) -> None:
        self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        try:
            async for msg in self._call:
                yield audio_chunk(msg)
        except grpc.RpcError as exc:
            raise honest_error(exc) from None


class AsyncClient:
    """`tls_ca`: verify the gateway's TLS certificate with this CA file (None: plaintext);
    `token`: bearer token for a gateway run with --auth-tokens; `server_name`: the name in the
    gateway's certificate when `target` is an IP."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        tls_ca: str | None = None,
        token: str | None = None,
        server_name: str | None = None,
    ):
        self.channel, self.metadata = _open_channel(grpc.aio, target, tls_ca, token, server_name)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()

    def stream(self, voice: VoiceData | str, **kw) -> AsyncStream:
        return AsyncStream(self.stub, voice, metadata=self.metadata, **kw)

    async def register_voice(self, voice: VoiceData) -> str:
        resp = await self.stub.RegisterVoice(
            gateway_pb2.RegisterVoiceRequest(voice=voice.to_proto()), metadata=self.metadata
        )
        return resp.voice_id

    async def delete_voice(self, voice_id: str) -> None:
        await self.stub.DeleteVoice(
            gateway_pb2.DeleteVoiceRequest(voice_id=voice_id), metadata=self.metadata
        )


class Stream:
    """The synchronous twin of AsyncStream (gRPC reads the request queue on its own thread)."""

    def __init__(
        self,
        stub,
        voice,
        audio_format="float32",
        request_id="",
        schedule=None,
        timeout=None,
        metadata=(),
    ):
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(_config(voice, audio_format, request_id, schedule))
        self._call = stub.Synthesize(
            iter(self._requests.get, None), timeout=timeout, metadata=metadata
        )

    def send(self, tokens: Iterable[int]) -> None:
        ids = [int(t) for t in tokens]
        if ids:
            self._requests.put(
                gateway_pb2.SynthesizeRequest(tokens=gateway_pb2.TokenChunk(tokens=ids))
            )

    def end(self) -> None:
        self._requests.put(gateway_pb2.SynthesizeRequest(end=gateway_pb2.EndOfInput()))
        self._requests.put(None)

    def cancel(self) -> None:
        self._call.cancel()

    def __iter__(self) -> Iterator[AudioChunk]:
        try:
            for msg in self._call:
                yield audio_chunk(msg)
        except grpc.RpcError as exc:
            raise honest_error(exc) from None


class Client:
    """The synchronous twin of AsyncClient (same arguments)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        tls_ca: str | None = None,
        token: str | None = None,
        server_name: str | None = None,
    ):
        self.channel, self.metadata = _open_channel(grpc, target, tls_ca, token, server_name)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.channel.close()

    def stream(self, voice: VoiceData | str, **kw) -> Stream:
        return Stream(self.stub, voice, metadata=self.metadata, **kw)

    def register_voice(self, voice: VoiceData) -> str:
        return self.stub.RegisterVoice(
            gateway_pb2.RegisterVoiceRequest(voice=voice.to_proto()), metadata=self.metadata
        ).voice_id

    def delete_voice(self, voice_id: str) -> None:
        self.stub.DeleteVoice(
            gateway_pb2.DeleteVoiceRequest(voice_id=voice_id), metadata=self.metadata
        )

    def synthesize(self, voice: VoiceData | str, tokens, **kw) -> np.ndarray:
        stream = self.stream(voice, **kw)
        stream.send(tokens)
        stream.end()
        return np.concatenate([c.samples for c in stream] or [np.zeros(0, np.float32)])


# -- CLI -------------------------------------------------------------------------------------


def write_wav(path: str | Path, samples: np.ndarray) -> None:
    pcm = np.clip(np.round(samples * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.tobytes())


def make_sample(out_dir: str | Path, prompt_tokens: int = 75, tokens: int = 250, seed: int = 0):
    """A random voice and token sequence (random weights make noise-like audio anyway)."""
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(
        out / "voice.npz",
        prompt_token=rng.integers(0, 6561, prompt_tokens).astype(np.int32),
        prompt_feat=(rng.standard_normal((2 * prompt_tokens, 80)) - 5).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
    )
    np.save(out / "tokens.npy", rng.integers(0, 6561, tokens).astype(np.int32))
    return out / "voice.npz", out / "tokens.npy"


def run_synthesis(
    target: str,
    voice: VoiceData,
    tokens: np.ndarray,
    out: str | None,
    pace: float = 0.0,
    audio_format: str = "pcm16",
    progress: bool = True,
) -> dict:
    """Stream tokens (all at once, or `pace` tokens/s), collect audio; returns the figures."""
    planner = ChunkPlanner(voice.num_prompt_tokens, ScheduleConfig())
    first_needed = min(len(tokens), planner.first_hop + LOOKAHEAD_TOKENS)
    with Client(target) as client:
        stream = client.stream(voice, audio_format=audio_format)
        t0 = time.perf_counter()
        first_tokens_sent = [t0]

        def feed():
            if pace <= 0:
                stream.send(tokens)
            else:
                for i, tok in enumerate(tokens):
                    time.sleep(max(0.0, t0 + i / pace - time.perf_counter()))
                    stream.send([tok])
                    if i + 1 == first_needed:
                        first_tokens_sent[0] = time.perf_counter()
            stream.end()

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        chunks = []
        expected = SAMPLES_PER_TOKEN * len(tokens)
        for chunk in stream:
            chunks.append(chunk)
            if progress:
                got = chunk.sample_offset + chunk.samples.size
                bar = "#" * int(30 * got / expected)
                print(
                    f"\r[{bar:<30}] {got / SAMPLE_RATE:6.2f}/{expected / SAMPLE_RATE:.2f} s "
                    f"chunk {chunk.seq}",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        feeder.join()
        wall = time.perf_counter() - t0
    if progress:
        print(file=sys.stderr)
    audio = np.concatenate([c.samples for c in chunks])
    if out:
        write_wav(out, audio)
    seconds = audio.size / SAMPLE_RATE
    return {
        "chunks": len(chunks),
        "audio_seconds": seconds,
        "wall_seconds": wall,
        "first_chunk_ms": (chunks[0].received_at - first_tokens_sent[0]) * 1e3,
        "rtf": wall / seconds,
        "xrt": seconds / wall,
        "samples": audio.size,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gateway.client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synthesize", help="stream tokens through the gateway into a WAV file")
    s.add_argument("--target", default="127.0.0.1:50051", help="gateway HOST:PORT")
    s.add_argument("--voice", required=True, help=".npz with prompt_token, prompt_feat, embedding")
    s.add_argument("--tokens", required=True, help=".npy of speech token ids (int)")
    s.add_argument("--out", required=True, help="output WAV (24 kHz, 16-bit mono)")
    s.add_argument(
        "--pace",
        type=float,
        default=0.0,
        help="send tokens at this rate per second, like an LLM (0: all at once)",
    )
    s.add_argument("--format", choices=sorted(FORMATS), default="pcm16", help="wire audio format")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    m = sub.add_parser("make-sample", help="write a random sample voice.npz and tokens.npy")
    m.add_argument("--out-dir", default="sample", help="where to write them")
    m.add_argument("--prompt-tokens", type=int, default=75, help="prompt length (3 s = 75)")
    m.add_argument("--num-tokens", type=int, default=250, help="utterance length (10 s = 250)")
    m.add_argument("--seed", type=int, default=0, help="random seed")
    a = p.parse_args(argv)
    if a.cmd == "make-sample":
        v, t = make_sample(a.out_dir, a.prompt_tokens, a.num_tokens, a.seed)
        print(f"wrote {v} and {t}")
        return 0
    voice = load_voice(a.voice)
    tokens = np.load(a.tokens).astype(np.int64).reshape(-1)
    try:
        r = run_synthesis(a.target, voice, tokens, a.out, a.pace, a.format, not a.quiet)
    except grpc.RpcError as exc:
        print(f"synthesis failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"wrote {a.out}: {r['audio_seconds']:.2f} s of audio in {r['chunks']} chunks")
    print(
        f"first-chunk latency {r['first_chunk_ms']:.0f} ms, real-time factor {r['rtf']:.3f} "
        f"({r['xrt']:.1f}x real time)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
