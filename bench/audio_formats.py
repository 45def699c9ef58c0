"""What the gateway's output formats cost, per stream: CPU per second of audio, the time each
chunk spends in the encoder, the audio it holds back, and the bytes it sends.

    python -m bench audio-formats                 # every format and rate, 10 s
    python -m bench audio-formats --seconds 30 --repeats 5 --markdown

One stream at a time through gateway/audio_format.py's StreamEncoder, in the chunks the
gateway's default schedule cuts a 10 s utterance into (hops of 25, 50, 100, 100... tokens of
960 samples; a 75-token prompt needs no pad). The input is a speech-like signal (harmonics of
a gliding pitch), which is what Opus's variable bitrate sees in real speech; the small random
preset's noise costs Opus more bits. Figures:

- cpu ms/s: encoder thread CPU time per second of audio (one core: 1000 / it = streams per
  core, were encoding the only work);
- first chunk ms, chunk ms p50 / max: wall time of a chunk's encode call, what it adds to
  that chunk (the first, 1 s of audio, is the one first-chunk latency sees);
- held ms: audio the final-less chunks held back on average (resampler delay, Opus's partial
  20 ms frame and lookahead, the open Ogg page, MP3's frame and delay, as a decoder fed the
  bytes so far sees it): it reaches the client with the next chunk;
- kbit/s: bytes sent per second of audio, next to PCM16 at 24 kHz (384 kbit/s).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import av
import numpy as np

from gateway.audio_format import (
    MP3_DELAY,
    OPUS_FRAME_S,
    AudioFormat,
    OutputSpec,
    StreamEncoder,
    check_output,
    split_packets,
)
from gateway.schedule import ScheduleConfig
from token2wav import SAMPLE_RATE, SAMPLES_PER_TOKEN

OPUS_LOOKAHEAD_S = 0.0065  # libopus's, the Ogg pre-skip (312 samples at 48 kHz)
CASES = [
    (AudioFormat.PCM16, 24000),
    (AudioFormat.FLOAT32, 24000),
    (AudioFormat.WAV, 24000),
    (AudioFormat.PCM16, 8000),
    (AudioFormat.PCM16, 16000),
    (AudioFormat.PCM16, 22050),
    (AudioFormat.PCM16, 44100),
    (AudioFormat.PCM16, 48000),
    (AudioFormat.MULAW, 8000),
    (AudioFormat.ALAW, 8000),
    (AudioFormat.OPUS_OGG, 8000),
    (AudioFormat.OPUS_OGG, 16000),
    (AudioFormat.OPUS_OGG, 24000),
    (AudioFormat.OPUS_OGG, 48000),
    (AudioFormat.OPUS_PACKETS, 24000),
    (AudioFormat.OPUS_PACKETS, 48000),
    (AudioFormat.MP3, 24000),
    (AudioFormat.MP3, 48000),
]


def speechlike(n: int, seed: int = 0) -> np.ndarray:
    """A voiced-speech stand-in at 24 kHz: 11 harmonics of a gliding 110-170 Hz pitch, a
    syllable-rate envelope, a little noise. Opus is a perceptual codec; on white noise its
    waveform SNR is a few dB whatever the bitrate, on this it is 20-26 dB."""
    t = np.arange(n) / SAMPLE_RATE
    phase = 2 * np.pi * np.cumsum(140 + 30 * np.sin(2 * np.pi * 0.7 * t)) / SAMPLE_RATE
    voiced = sum((0.5 / k) * np.sin(k * phase) for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 2.5 * t)
    noise = 0.003 * np.random.default_rng(seed).standard_normal(n)
    return (0.3 * voiced * envelope + noise).astype(np.float32)


def chunk_sizes(seconds: float) -> list[int]:
    """Samples per chunk of the default schedule for an utterance of `seconds`."""
    tokens = round(seconds * SAMPLE_RATE / SAMPLES_PER_TOKEN)
    sizes, done = [], 0
    for hop in ScheduleConfig().hops(tokens):
        if done >= tokens:
            break
        sizes.append(min(hop, tokens - done) * SAMPLES_PER_TOKEN)
        done += sizes[-1] // SAMPLES_PER_TOKEN
    return sizes


def run_case(spec: OutputSpec, x: np.ndarray, sizes: list[int]) -> dict:
    enc = StreamEncoder(spec)
    opus = spec.audio_format in (AudioFormat.OPUS_OGG, AudioFormat.OPUS_PACKETS)
    mp3 = av.codec.CodecContext.create("mp3", "r") if spec.audio_format == AudioFormat.MP3 else None
    num_decoded = 0  # MP3 samples a decoder got from the frames so far
    walls, held, num_bytes, fed, num_packets = [], [], 0, 0, 0
    cpu = 0.0  # encode calls only (not the held-back bookkeeping below)
    for k, n in enumerate(sizes):
        last = k == len(sizes) - 1
        t0, c0 = time.perf_counter(), time.thread_time()
        data, _ = enc.encode(x[fed : fed + n], last)
        walls.append(time.perf_counter() - t0)
        cpu += time.thread_time() - c0
        fed += n
        num_bytes += len(data)
        if last:
            break
        # Audio fed so far minus what the client can decode from what it got, at 24 kHz.
        if opus:
            if spec.audio_format == AudioFormat.OPUS_PACKETS:
                num_packets += len(split_packets(data))
            else:
                num_packets += _ogg_packets(data)
            decodable_s = max(0.0, num_packets * OPUS_FRAME_S - OPUS_LOOKAHEAD_S)
        elif mp3 is not None:
            num_decoded += sum(f.samples for p in mp3.parse(data) for f in mp3.decode(p))
            decodable_s = max(0, num_decoded - MP3_DELAY) / spec.sample_rate
        else:
            decodable_s = enc.num_samples / spec.sample_rate
        held.append(1e3 * (fed / SAMPLE_RATE - decodable_s))
    seconds = len(x) / SAMPLE_RATE
    return {
        "cpu_ms_per_s": 1e3 * cpu / seconds,
        "first_chunk_ms": 1e3 * walls[0],
        "chunk_ms_p50": 1e3 * statistics.median(walls),
        "chunk_ms_max": 1e3 * max(walls),
        "held_ms": statistics.mean(held) if held else 0.0,
        "kbps": 8 * num_bytes / seconds / 1e3,
    }


def _ogg_packets(pages: bytes) -> int:
    """Audio packets in whole Ogg pages (header packets not counted)."""
    n, i = 0, 0
    while i < len(pages):
        assert pages[i : i + 4] == b"OggS"
        num_segments = pages[i + 26]
        lacing = pages[i + 27 : i + 27 + num_segments]
        body = i + 27 + num_segments
        if pages[body : body + 8] not in (b"OpusHead", b"OpusTags"):
            n += sum(1 for v in lacing if v < 255)
        i = body + sum(lacing)
    return n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="utterance length (default 10)")
    p.add_argument(
        "--repeats", type=int, default=5, help="runs per case, each figure's best kept (default 5)"
    )
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.repeats < 1:
        p.error("--seconds and --repeats: want > 0 and >= 1")
    x = speechlike(round(args.seconds * SAMPLE_RATE))
    sizes = chunk_sizes(args.seconds)
    x = x[: sum(sizes)]
    tokens = [n // SAMPLES_PER_TOKEN for n in sizes]
    print(f"{len(sizes)} chunks of {tokens} tokens; {platform.machine()}, one thread")
    head = (
        "| format | rate | cpu ms/s | first chunk ms | chunk ms p50 | chunk ms max | held ms "
        "| kbit/s |"
    )
    print(head if args.markdown else head.replace("|", " "))
    if args.markdown:
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for fmt, rate in CASES:
        spec = check_output(fmt, rate)
        runs = [run_case(spec, x, sizes) for _ in range(args.repeats)]
        # Each figure's best run: what the encoder costs, less what other processes took.
        best = {k: min(r[k] for r in runs) for k in runs[0]}
        row = (
            f"| {fmt.name} | {rate} | {best['cpu_ms_per_s']:.2f} | {best['first_chunk_ms']:.2f} "
            f"| {best['chunk_ms_p50']:.2f} "
            f"| {best['chunk_ms_max']:.2f} | {best['held_ms']:.1f} | {best['kbps']:.1f} |"
        )
        print(row if args.markdown else row.replace("|", " "))
