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
    python -m gateway.client synthesize --audio prompt.wav --tokens t.npy --out out.wav
    python -m gateway.client make-sample --out-dir sample/
    python -m gateway.client make-voice --audio prompt.wav --frontend-dir DIR --out voice.npz
    python -m gateway.client import-speakers spk2info.pt --out-dir voices/
    python -m gateway.client export-speakers --out spk2info.pt alice=voices/alice.npz
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
from gateway.voice_cli import (
    VOICE_COMMANDS,
    add_voice_commands,
    run_voice_command,
    voice_from_gateway,
)
from token2wav import SAMPLE_RATE, SAMPLES_PER_TOKEN
from token2wav.server import channel_options
from token2wav.tensors import INT_DTYPES, VoiceData, decode, decode_voice, encode, make_voice
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
    if msg.audio_format == gateway_pb2.AUDIO_FORMAT_FLOAT32:
        return np.frombuffer(msg.audio, "<f4").astype(np.float32)
    return np.frombuffer(msg.audio, "<i2").astype(np.float32) / 32768.0


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


class AsyncStream:
    """One Synthesize stream. Send tokens as they come, then `end()`; iterate the audio."""

    def __init__(
        self, stub, voice, audio_format="float32", request_id="", schedule=None, timeout=None
    ):
        self._requests: asyncio.Queue = asyncio.Queue()
        self._requests.put_nowait(_config(voice, audio_format, request_id, schedule))
        self._call = stub.Synthesize(self._iter_requests(), timeout=timeout)

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
        async for msg in self._call:
            yield AudioChunk(
                msg.seq,
                msg.sample_offset,
                decode_audio(msg),
                msg.is_final,
                msg.timing,
                time.perf_counter(),
            )


class AsyncClient:
    def __init__(self, target: str = "127.0.0.1:50051"):
        self.channel = grpc.aio.insecure_channel(target, options=channel_options())
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()

    def stream(self, voice: VoiceData | str, **kw) -> AsyncStream:
        return AsyncStream(self.stub, voice, **kw)

    async def register_voice(self, voice: VoiceData) -> str:
        resp = await self.stub.RegisterVoice(
            gateway_pb2.RegisterVoiceRequest(voice=voice.to_proto())
        )
        return resp.voice_id

    async def register_audio(self, audio_file=None, pcm=None, sample_rate=0) -> RegisteredVoice:
        """Have the gateway make a voice from a recording (see `audio_request`)."""
        return _registered(
            await self.stub.RegisterVoice(audio_request(audio_file, pcm, sample_rate))
        )

    async def delete_voice(self, voice_id: str) -> None:
        await self.stub.DeleteVoice(gateway_pb2.DeleteVoiceRequest(voice_id=voice_id))


class Stream:
    """The synchronous twin of AsyncStream (gRPC reads the request queue on its own thread)."""

    def __init__(
        self, stub, voice, audio_format="float32", request_id="", schedule=None, timeout=None
    ):
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(_config(voice, audio_format, request_id, schedule))
        self._call = stub.Synthesize(iter(self._requests.get, None), timeout=timeout)

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
        for msg in self._call:
            yield AudioChunk(
                msg.seq,
                msg.sample_offset,
                decode_audio(msg),
                msg.is_final,
                msg.timing,
                time.perf_counter(),
            )


class Client:
    def __init__(self, target: str = "127.0.0.1:50051"):
        self.channel = grpc.insecure_channel(target, options=channel_options())
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.channel.close()

    def stream(self, voice: VoiceData | str, **kw) -> Stream:
        return Stream(self.stub, voice, **kw)

    def register_voice(self, voice: VoiceData) -> str:
        return self.stub.RegisterVoice(
            gateway_pb2.RegisterVoiceRequest(voice=voice.to_proto())
        ).voice_id

    def register_audio(self, audio_file=None, pcm=None, sample_rate=0) -> RegisteredVoice:
        return _registered(self.stub.RegisterVoice(audio_request(audio_file, pcm, sample_rate)))

    def delete_voice(self, voice_id: str) -> None:
        self.stub.DeleteVoice(gateway_pb2.DeleteVoiceRequest(voice_id=voice_id))

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
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--voice", help=".npz with prompt_token, prompt_feat, embedding")
    which.add_argument(
        "--audio",
        help="prompt recording (WAV/FLAC/OGG) the gateway makes the voice from "
        "(it needs --frontend-dir)",
    )
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
    add_voice_commands(sub)
    a = p.parse_args(argv)
    if a.cmd in VOICE_COMMANDS:
        return run_voice_command(a)
    if a.cmd == "make-sample":
        v, t = make_sample(a.out_dir, a.prompt_tokens, a.num_tokens, a.seed)
        print(f"wrote {v} and {t}")
        return 0
    tokens = np.load(a.tokens).astype(np.int64).reshape(-1)
    try:
        voice = load_voice(a.voice) if a.voice else voice_from_gateway(a.target, a.audio)
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
