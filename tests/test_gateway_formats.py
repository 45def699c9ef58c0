"""Every output format and rate through the real stack on loopback (small presets, CPU), in one
stack: concurrent streams of the same input, each decoded and compared with the stack's own
24 kHz float32 stream of it, resampled by soxr's one-shot call (the oracle of
tests/test_audio_format.py); then the CLI's .wav and .opus files, and the refusals."""

from __future__ import annotations

import asyncio
import io
import wave

import av
import grpc
import numpy as np
import pytest
import soxr
import torch
from _stack import start_stack, stream_inputs
from test_audio_format import alaw_decode, decode_packets, mulaw_decode, snr_db

from flow_service.model import load_flow
from gateway import audio_format as af
from gateway.client import AsyncClient, run_synthesis
from token2wav import SAMPLE_RATE, SAMPLES_PER_TOKEN
from vocoder_service.model import load_hift

torch.set_num_threads(1)

N_PROMPT, N_TOKENS = 20, 50  # 2 s of audio: 2 chunks (25 + 25 tokens)
CASES = [  # (format name, rate)
    ("pcm16", 16000),
    ("pcm16", 44100),
    ("float32", 8000),
    ("float32", 48000),
    ("wav", 22050),
    ("mulaw", 8000),
    ("alaw", 8000),
    ("opus_ogg", 48000),
    ("opus_ogg", 16000),
    ("opus_packets", 24000),
    ("mp3", 22050),
]
# The stack's audio is a random-weight HiFT's noise, on which a perceptual codec's waveform
# SNR is small (white noise measured 1.8-4.0 dB at 32 kbit/s); above 0 dB it is the signal.
OPUS_NOISE_SNR_DB = 1.0


@pytest.fixture(scope="module")
def models():
    return load_flow(None, preset="small"), load_hift(None, preset="small")


async def collect(client, voice, tokens, fmt, rate, request_id):
    stream = client.stream(voice, audio_format=fmt, sample_rate=rate, request_id=request_id)
    await stream.send(tokens)
    await stream.end()
    return [c async for c in stream]


def check_counts(chunks, rate):
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    offset = 0
    for c in chunks:
        assert c.sample_offset == offset and c.sample_rate == rate
        offset += c.num_samples
    assert offset == N_TOKENS * SAMPLES_PER_TOKEN * rate // SAMPLE_RATE
    assert chunks[-1].is_final and not any(c.is_final for c in chunks[:-1])


def decoded(fmt: str, chunks) -> np.ndarray:
    data = b"".join(c.audio for c in chunks)
    if fmt == "float32":
        return np.frombuffer(data, "<f4")
    if fmt == "pcm16":
        return np.frombuffer(data, "<i2") / 32768
    if fmt == "wav":
        with wave.open(io.BytesIO(data)) as w:
            return np.frombuffer(w.readframes(10**9), "<i2") / 32768
    if fmt in ("mulaw", "alaw"):
        codes = np.frombuffer(data, np.uint8)
        return (mulaw_decode(codes) if fmt == "mulaw" else alaw_decode(codes)) / 32768
    if fmt in ("opus_ogg", "mp3"):
        with av.open(io.BytesIO(data), format="ogg" if fmt == "opus_ogg" else "mp3") as c:
            return np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    packets = [p for c in chunks for p in af.split_packets(c.audio)]
    return decode_packets(packets)[0]


async def test_every_format_and_rate_through_the_stack(models, tmp_path):
    stack = await start_stack(models)
    try:
        voice, tokens = stream_inputs(7, N_PROMPT, N_TOKENS)
        async with AsyncClient(stack.target) as client:
            ref_chunks, *results = await asyncio.gather(
                collect(client, voice, tokens, "float32", 0, "ref"),
                *[collect(client, voice, tokens, f, r, f"{f}-{r}") for f, r in CASES],
            )
            # Refusals name the field, through the real servicer.
            for fmt, rate, words in [("mulaw", 16000, "8000 Hz only"), ("pcm16", 11025, "11025")]:
                with pytest.raises(grpc.RpcError) as info:
                    await collect(client, voice, tokens, fmt, rate, "refused")
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "config.sample_rate" in info.value.details()
                assert words in info.value.details()
        check_counts(ref_chunks, SAMPLE_RATE)
        ref = np.concatenate([c.samples for c in ref_chunks])
        for (fmt, rate), chunks in zip(CASES, results):
            check_counts(chunks, rate)
            got = decoded(fmt, chunks)
            if fmt == "mp3":
                want = soxr.resample(ref, SAMPLE_RATE, rate, quality=af.RESAMPLE_QUALITY)
                got = got[af.MP3_DELAY : af.MP3_DELAY + len(want)]
                assert len(got) == len(want)
                assert snr_db(want, got) > OPUS_NOISE_SNR_DB, (fmt, rate, snr_db(want, got))
                continue
            if fmt.startswith("opus"):
                want = soxr.resample(ref, SAMPLE_RATE, 48000)  # Opus decodes at 48 kHz
                if fmt == "opus_packets":  # starts with the encoder's lookahead
                    got = got[312 : 312 + len(want)]
                assert len(got) == len(want), (fmt, rate)
                assert snr_db(want, got) > OPUS_NOISE_SNR_DB, (fmt, rate, snr_db(want, got))
                continue
            want = soxr.resample(ref, SAMPLE_RATE, rate, quality=af.RESAMPLE_QUALITY)
            assert len(got) == len(want), (fmt, rate)
            # The same stream's audio in another batch is equal to ~1e-4 (invariant 1);
            # then PCM16 rounding (~90 dB at these levels) or G.711's companding (~38 dB).
            bar = 30 if fmt in ("mulaw", "alaw") else 50
            assert snr_db(want, got) > bar, (fmt, rate, snr_db(want, got))
        # The CLI: the file type by extension, the rate by --sample-rate.
        out_wav, out_opus = tmp_path / "out.wav", tmp_path / "out.opus"
        for out in (out_wav, out_opus):
            r = await asyncio.to_thread(
                run_synthesis,
                stack.target,
                voice,
                tokens,
                str(out),
                0.0,
                "pcm16",
                False,
                sample_rate=16000,
            )
            assert r["samples"] == N_TOKENS * SAMPLES_PER_TOKEN * 2 // 3
        with wave.open(str(out_wav)) as w:
            assert (w.getframerate(), w.getnframes()) == (16000, r["samples"])
        with av.open(str(out_opus)) as c:
            stream = c.streams.audio[0]
            assert stream.codec_context.name in ("opus", "libopus")
            n = sum(f.samples for f in c.decode(audio=0))
        assert n == r["samples"] * 3  # decoded at 48 kHz, trimmed to the stream's length
        assert not stack.sessions()
    finally:
        await stack.stop()
