"""The audio a client asked for: its sample rate and format, made from the vocoder's 24 kHz
float32 chunks one stream at a time.

- Rates: soxr's streaming resampler, whose chunked output equals its one-shot resample of the
  whole stream (tests/test_audio_format.py checks it sample for sample).
- Formats: PCM16, FLOAT32, WAV (PCM16 after a streaming RIFF header), mu-law and A-law
  (G.711, 8 kHz only), Opus (libopus through PyAV's FFmpeg) in Ogg pages or as raw 20 ms
  packets, and MP3 (LAME, bare MPEG frames).

Counting: a chunk's `num_samples` is the number of samples, at the stream's rate, that the
chunk adds to the stream; `sample_offset`s stay contiguous and the stream's total is the whole
resampled utterance. PCM formats carry exactly those samples. The resampler's filter delay
makes the first chunks a little shorter and the final one longer by as much. Opus carries
them with a lag of less than one 20 ms frame plus the encoder's lookahead (and, in Ogg, the
last finished page, which FFmpeg's muxer holds until the next), which the final chunk flushes.

Encoding state (resampler, encoder, muxer) is per stream; the work runs in a small shared
thread pool (`encode` in the pipeline's order, one call per stream at a time) so the event loop
keeps serving other streams while a chunk is encoded.
"""

from __future__ import annotations

import asyncio
import enum
import io
import os
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import av
import numpy as np
import soxr

from token2wav import SAMPLE_RATE
from token2wav.errors import InvalidArgument

OUTPUT_RATES = (8000, 16000, 22050, 24000, 44100, 48000)  # Hz a stream may ask for
G711_RATE = 8000  # mu-law and A-law are telephony codecs: 8 kHz only
OPUS_RATES = (8000, 16000, 24000, 48000)  # libopus's own rates among OUTPUT_RATES
OPUS_FRAME_S = 0.020  # one packet: WebRTC's usual frame
OPUS_BITRATE = 32000  # bit/s, mono speech; Opus is transparent for speech near here
MP3_BITRATE = 64000  # bit/s CBR; MP3 needs about twice Opus's rate for the same speech
MP3_DELAY = 1105  # samples a decoder's output starts late by: LAME's 576 + the decoder's 529
# One packet per Ogg page. FFmpeg's muxer keeps the last finished page until the next one
# starts, so a chunk's end waits for the next chunk by up to a page plus the encoder's partial
# frame: 27-66 ms with 20 ms pages, 107-207 ms with 100 ms ones (bench/audio_formats.py),
# which would eat the client's buffer; the price is 28 framing bytes a page, ~9 kbit/s.
OGG_PAGE_S = 0.020
RESAMPLE_QUALITY = "HQ"  # soxr's default; VHQ measured no closer to the one-shot (both exact)
WAV_UNKNOWN_SIZE = 0xFFFFFFFF  # RIFF and data sizes of a stream whose length is not known yet
ENCODER_THREADS = min(4, os.cpu_count() or 1)  # shared by every stream of the process


class AudioFormat(enum.IntEnum):
    # The wire's gateway_pb2.AudioFormat numbers (protos/token2wav/v1/gateway.proto).
    PCM16 = 1
    FLOAT32 = 2
    MULAW = 3
    ALAW = 4
    OPUS_OGG = 5
    OPUS_PACKETS = 6
    WAV = 7
    MP3 = 8


@dataclass(frozen=True)
class OutputSpec:
    audio_format: AudioFormat = AudioFormat.PCM16
    sample_rate: int = SAMPLE_RATE

    @property
    def is_passthrough(self) -> bool:
        """The vocoder's own rate in PCM16/FLOAT32: converted on the loop, no encoder state."""
        return self.sample_rate == SAMPLE_RATE and self.audio_format in (
            AudioFormat.PCM16,
            AudioFormat.FLOAT32,
        )


def check_output(audio_format: int, sample_rate: int, field: str = "config") -> OutputSpec:
    """The stream's output from its StreamConfig numbers (0: the default), or InvalidArgument
    naming the field."""
    try:
        fmt = AudioFormat(audio_format or AudioFormat.PCM16)
    except ValueError:
        raise InvalidArgument(f"{field}.audio_format", f"unknown format {audio_format}") from None
    rate = sample_rate or SAMPLE_RATE
    if rate not in OUTPUT_RATES:
        raise InvalidArgument(
            f"{field}.sample_rate", f"{rate} Hz: want one of {', '.join(map(str, OUTPUT_RATES))}"
        )
    if fmt in (AudioFormat.MULAW, AudioFormat.ALAW) and rate != G711_RATE:
        raise InvalidArgument(
            f"{field}.sample_rate", f"{fmt.name} is 8000 Hz only (got {rate}; set 8000)"
        )
    if fmt in (AudioFormat.OPUS_OGG, AudioFormat.OPUS_PACKETS) and rate not in OPUS_RATES:
        raise InvalidArgument(
            f"{field}.sample_rate",
            f"Opus takes {', '.join(map(str, OPUS_RATES))} Hz (got {rate})",
        )
    return OutputSpec(fmt, rate)


def to_pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> int16 little-endian: scaled by 32767, rounded half to even, clipped
    (the rule the 24 kHz PCM16 path uses)."""
    return np.clip(np.rint(samples * 32767.0), -32768, 32767).astype("<i2").tobytes()


def wav_header(sample_rate: int) -> bytes:
    """A 44-byte RIFF/WAVE header of 16-bit mono PCM whose length is not known yet: both sizes
    are 0xFFFFFFFF, which streaming readers take as "read to the end"."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, 2 * sample_rate, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", WAV_UNKNOWN_SIZE)
        + b"WAVEfmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", WAV_UNKNOWN_SIZE)
    )


def split_packets(audio: bytes) -> list[bytes]:
    """OPUS_PACKETS framing: each packet is a 2-byte little-endian length, then the packet."""
    packets, i = [], 0
    while i < len(audio):
        (n,) = struct.unpack_from("<H", audio, i)
        packets.append(audio[i + 2 : i + 2 + n])
        i += 2 + n
    if i != len(audio):
        raise ValueError("OPUS_PACKETS audio ends inside a packet")
    return packets


class _Sink(io.RawIOBase):
    """Where the Ogg muxer writes; each chunk takes what was written since the last one."""

    def __init__(self):
        self._buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class StreamEncoder:
    """One stream's resampler and encoder. `encode` takes the vocoder's next 24 kHz float32
    chunk and returns (bytes for the client, samples at the output rate they add)."""

    def __init__(self, spec: OutputSpec):
        self.spec = spec
        self.num_samples = 0  # output samples so far: the next chunk's sample_offset
        self._resampler = (
            soxr.ResampleStream(
                SAMPLE_RATE, spec.sample_rate, 1, dtype="float32", quality=RESAMPLE_QUALITY
            )
            if spec.sample_rate != SAMPLE_RATE
            else None
        )
        self._first = True
        self._closed = False
        self._pts = 0
        self._codec = None
        self._container = self._stream = self._sink = None
        fmt = spec.audio_format
        if fmt in (AudioFormat.MULAW, AudioFormat.ALAW):
            self._codec = self._open_codec("pcm_mulaw" if fmt == AudioFormat.MULAW else "pcm_alaw")
        elif fmt == AudioFormat.OPUS_PACKETS:
            self._codec = self._open_codec("libopus", bit_rate=OPUS_BITRATE, fmt="flt")
        elif fmt == AudioFormat.MP3:
            self._codec = self._open_codec("libmp3lame", bit_rate=MP3_BITRATE, fmt="fltp")
        elif fmt == AudioFormat.OPUS_OGG:
            self._sink = _Sink()
            page_us = str(round(OGG_PAGE_S * 1e6))
            # bitexact: stream serial 0 instead of a random one, so the same audio always
            # makes the same bytes (one logical stream per file: nothing to tell apart).
            self._container = av.open(
                self._sink,
                mode="w",
                format="ogg",
                options={"page_duration": page_us, "fflags": "+bitexact"},
            )
            self._stream = self._container.add_stream(
                "libopus", rate=spec.sample_rate, layout="mono"
            )
            self._stream.codec_context.bit_rate = OPUS_BITRATE
            self._stream.codec_context.format = "flt"

    def _open_codec(self, name: str, bit_rate: int = 0, fmt: str = "s16"):
        cc = av.codec.CodecContext.create(name, "w")
        cc.sample_rate, cc.layout, cc.format = self.spec.sample_rate, "mono", fmt
        if bit_rate:
            cc.bit_rate = bit_rate
        cc.open()
        return cc

    def _frame(self, samples: np.ndarray, fmt: str) -> av.AudioFrame:
        frame = av.AudioFrame.from_ndarray(samples[None, :], format=fmt, layout="mono")
        frame.sample_rate, frame.pts = self.spec.sample_rate, self._pts
        self._pts += len(samples)
        return frame

    def encode(self, samples: np.ndarray, last: bool) -> tuple[bytes, int]:
        if self._closed:
            raise RuntimeError("encode after the final chunk")
        samples = np.asarray(samples, dtype=np.float32)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples, last=last)
        self.num_samples += len(samples)
        fmt = self.spec.audio_format
        if fmt == AudioFormat.FLOAT32:
            data = samples.astype("<f4").tobytes()
        elif fmt in (AudioFormat.PCM16, AudioFormat.WAV):
            data = to_pcm16(samples)
            if fmt == AudioFormat.WAV and self._first:
                data = wav_header(self.spec.sample_rate) + data
        elif fmt in (AudioFormat.MULAW, AudioFormat.ALAW):
            pcm = np.frombuffer(to_pcm16(samples), "<i2")
            packets = self._codec.encode(self._frame(pcm, "s16")) if len(pcm) else []
            data = b"".join(bytes(p) for p in packets)
        elif fmt == AudioFormat.OPUS_PACKETS:
            packets = list(self._codec.encode(self._frame(samples, "flt"))) if len(samples) else []
            if last:
                packets += self._codec.encode(None)
            data = b"".join(struct.pack("<H", p.size) + bytes(p) for p in packets)
        elif fmt == AudioFormat.MP3:
            packets = list(self._codec.encode(self._frame(samples, "fltp"))) if len(samples) else []
            if last:
                packets += self._codec.encode(None)
            data = b"".join(bytes(p) for p in packets)
        else:  # OPUS_OGG
            if len(samples):
                for packet in self._stream.encode(self._frame(samples, "flt")):
                    self._container.mux(packet)
            if last:
                for packet in self._stream.encode(None):
                    self._container.mux(packet)
                self._container.close()  # the last page, with the end-of-stream flag
                self._container = None
            data = self._sink.take()
        self._first = False
        self._closed = last
        return data, len(samples)

    def close(self) -> None:
        """Frees the FFmpeg state of a stream that ended early (the final chunk does it too)."""
        if self._container is not None:
            self._container.close()
            self._container = None
        self._codec = None
        self._closed = True


_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(ENCODER_THREADS, thread_name_prefix="audio-encode")
    return _pool


def submit(encoder: StreamEncoder, samples: np.ndarray, last: bool) -> Future:
    """`encoder.encode` on the shared pool. Callers wait for each chunk before the next, so one
    stream's encoder is never used by two threads at once."""
    return _executor().submit(encoder.encode, samples, last)


async def encode(encoder: StreamEncoder, samples: np.ndarray, last: bool) -> tuple[bytes, int]:
    """`encoder.encode` off the event loop."""
    return await asyncio.wrap_future(submit(encoder, samples, last))


class ClientAudio:
    """The gateway's hook: rewrites each 24 kHz FLOAT32 SynthesizeResponse of one stream into
    the stream's rate and format (seq unchanged; sample_offset and num_samples in output
    samples; encoding time added to timing.gateway_ms)."""

    def __init__(self, spec: OutputSpec):
        self.spec = spec
        self._encoder = StreamEncoder(spec)
        self._inflight: Future | None = None  # the chunk being encoded, if any

    async def convert(self, msg):
        started = time.perf_counter()
        samples = np.frombuffer(msg.audio, dtype="<f4")
        offset = self._encoder.num_samples
        self._inflight = submit(self._encoder, samples, msg.is_final)
        data, num_samples = await asyncio.wrap_future(self._inflight)
        msg.audio = data
        msg.num_samples = num_samples
        msg.sample_offset = offset
        msg.sample_rate = self.spec.sample_rate
        msg.audio_format = int(self.spec.audio_format)
        msg.timing.gateway_ms += (time.perf_counter() - started) * 1e3
        return msg

    def close(self) -> None:
        """Frees the encoder; a stream cancelled mid-chunk leaves its encode running on the
        pool, and FFmpeg's state must not be freed under it: then it is freed right after."""
        if self._inflight is not None and not self._inflight.done():
            self._inflight.add_done_callback(lambda _: self._encoder.close())
        else:
            self._encoder.close()
