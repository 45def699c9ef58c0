"""gateway/audio_format.py without a stack: rates against soxr's one-shot resample, G.711 against
its formula, Opus decoded by FFmpeg (through PyAV) against the input, WAV's header, the
field-naming refusals, and the encoding staying off the event loop."""

from __future__ import annotations

import asyncio
import io
import struct
import threading
import wave

import av
import numpy as np
import pytest
import soxr

from bench.audio_formats import speechlike
from gateway import audio_format as af
from gateway.audio_format import AudioFormat, OutputSpec, StreamEncoder, check_output
from token2wav import SAMPLE_RATE
from token2wav.errors import InvalidArgument
from token2wav.v1 import gateway_pb2

F = AudioFormat


def encode_in_pieces(spec: OutputSpec, x: np.ndarray, cuts) -> tuple[list[bytes], list[int]]:
    enc = StreamEncoder(spec)
    pieces = np.split(x, cuts)
    out = [enc.encode(p, last=k == len(pieces) - 1) for k, p in enumerate(pieces)]
    assert enc.num_samples == sum(n for _, n in out)
    return [d for d, _ in out], [n for _, n in out]


def snr_db(ref: np.ndarray, out: np.ndarray) -> float:
    ref, out = ref.astype(np.float64), out.astype(np.float64)
    noise = np.sum((ref - out) ** 2)
    return np.inf if noise == 0 else float(10 * np.log10(np.sum(ref**2) / noise))


# Chunk boundaries like the gateway's (a first chunk, then bigger ones) and awkward ones.
CUTS = [[26400, 50400, 98400], [1, 2, 4801, 4802, 70001]]


# ---- config -------------------------------------------------------------------------------


def test_enum_matches_the_wire():
    for fmt in F:
        assert gateway_pb2.AudioFormat.Value(f"AUDIO_FORMAT_{fmt.name}") == fmt.value
    assert len(gateway_pb2.AudioFormat.keys()) == len(F) + 1  # + UNSPECIFIED


def test_check_output_defaults_and_combinations():
    assert check_output(0, 0) == OutputSpec(F.PCM16, SAMPLE_RATE)
    assert check_output(0, 0).is_passthrough and check_output(F.FLOAT32, 24000).is_passthrough
    assert not check_output(F.PCM16, 16000).is_passthrough
    assert not check_output(F.WAV, 24000).is_passthrough
    for rate in af.OUTPUT_RATES:
        for fmt in (F.PCM16, F.FLOAT32, F.WAV):
            assert check_output(fmt, rate) == OutputSpec(fmt, rate)
    assert check_output(F.MULAW, 8000).audio_format == F.MULAW
    assert check_output(F.OPUS_PACKETS, 48000).sample_rate == 48000


@pytest.mark.parametrize(
    "fmt, rate, field, words",
    [
        (99, 0, "config.audio_format", "unknown format 99"),
        (0, 11025, "config.sample_rate", "11025 Hz"),
        (F.FLOAT32, 96000, "config.sample_rate", "96000 Hz"),
        (F.MULAW, 16000, "config.sample_rate", "MULAW is 8000 Hz only"),
        (F.ALAW, 0, "config.sample_rate", "ALAW is 8000 Hz only"),
        (F.OPUS_OGG, 44100, "config.sample_rate", "Opus takes"),
        (F.OPUS_PACKETS, 22050, "config.sample_rate", "Opus takes"),
    ],
)
def test_check_output_refuses_naming_the_field(fmt, rate, field, words):
    with pytest.raises(InvalidArgument) as info:
        check_output(fmt, rate)
    assert info.value.field == field and words in str(info.value)


# ---- rates --------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [r for r in af.OUTPUT_RATES if r != SAMPLE_RATE])
@pytest.mark.parametrize("cuts", CUTS)
def test_chunked_resample_equals_one_shot(rate, cuts):
    x = speechlike(SAMPLE_RATE * 5)
    data, counts = encode_in_pieces(OutputSpec(F.FLOAT32, rate), x, cuts)
    got = np.frombuffer(b"".join(data), "<f4")
    want = soxr.resample(x, SAMPLE_RATE, rate, quality=af.RESAMPLE_QUALITY)
    # Exact, not close: soxr's one-shot call runs the same streaming engine over one chunk,
    # and 40 random cuttings of 1-5 s signals at every rate measured 0.0 max abs difference.
    np.testing.assert_array_equal(got, want)
    assert sum(counts) == len(want) == len(x) * rate // SAMPLE_RATE


def test_pcm16_and_wav_at_a_rate():
    x = speechlike(SAMPLE_RATE * 2)
    want = af.to_pcm16(soxr.resample(x, SAMPLE_RATE, 16000, quality=af.RESAMPLE_QUALITY))
    pcm, counts = encode_in_pieces(OutputSpec(F.PCM16, 16000), x, CUTS[0])
    assert b"".join(pcm) == want and [len(d) for d in pcm] == [2 * n for n in counts]
    wav, wav_counts = encode_in_pieces(OutputSpec(F.WAV, 16000), x, CUTS[0])
    assert wav_counts == counts
    head = wav[0][:44]
    assert wav[0][44:] == pcm[0] and wav[1:] == pcm[1:]
    riff, size, wave_id, fmt_id, fmt_size = struct.unpack_from("<4sI4s4sI", head)
    assert (riff, wave_id, fmt_id, fmt_size) == (b"RIFF", b"WAVE", b"fmt ", 16)
    assert struct.unpack_from("<HHIIHH", head, 20) == (1, 1, 16000, 32000, 2, 16)
    assert head[36:40] == b"data" and size == struct.unpack_from("<I", head, 40)[0] == 0xFFFFFFFF
    # Python's own reader takes the streaming sizes as "to the end".
    with wave.open(io.BytesIO(b"".join(wav))) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        assert w.readframes(10**9) == want


def test_passthrough_rate_is_the_pipelines_rounding():
    x = np.array([0.5, -0.5, 1.0, -1.0, 1.5, -1.5, 0.0, 1e-9], np.float32)
    (data,), _ = encode_in_pieces(OutputSpec(F.PCM16, SAMPLE_RATE), x, [])
    assert np.frombuffer(data, "<i2").tolist() == [
        16384,
        -16384,
        32767,
        -32767,
        32767,
        -32768,
        0,
        0,
    ]


# ---- G.711 --------------------------------------------------------------------------------


def mulaw_decode(codes: np.ndarray) -> np.ndarray:
    """ITU-T G.711 mu-law expansion, by the formula (to the 16-bit scale)."""
    c = ~codes.astype(np.int32) & 0xFF
    exponent, mantissa = (c >> 4) & 7, c & 15
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(c & 0x80, -magnitude, magnitude)


def alaw_decode(codes: np.ndarray) -> np.ndarray:
    """ITU-T G.711 A-law expansion, by the formula (to the 16-bit scale)."""
    c = codes.astype(np.int32) ^ 0x55
    exponent, mantissa = (c >> 4) & 7, c & 15
    magnitude = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << (exponent - 1)
    )
    return np.where(c & 0x80, magnitude, -magnitude)


@pytest.mark.parametrize("fmt, decode", [(F.MULAW, mulaw_decode), (F.ALAW, alaw_decode)])
def test_g711_decodes_by_formula(fmt, decode):
    x = speechlike(SAMPLE_RATE * 2)
    data, counts = encode_in_pieces(OutputSpec(fmt, 8000), x, CUTS[1])
    assert [len(d) for d in data] == counts  # one byte a sample
    got = decode(np.frombuffer(b"".join(data), np.uint8))
    pcm = np.frombuffer(
        af.to_pcm16(soxr.resample(x, SAMPLE_RATE, 8000, quality=af.RESAMPLE_QUALITY)), "<i2"
    )
    assert len(got) == len(pcm) == len(x) // 3
    # Companding keeps 4 bits of mantissa: the error is at most half a step, 1/32 of the
    # magnitude plus the smallest step; the signal survives as G.711 promises.
    err = np.abs(got - pcm.astype(np.int64))
    assert np.all(err <= np.maximum(16, np.abs(pcm) // 16 + 16))
    assert snr_db(pcm, got) > 30
    # The code of silence is the standard one (a wrong bit inversion would still decode).
    (zeros,), _ = encode_in_pieces(OutputSpec(fmt, 8000), np.zeros(300, np.float32), [])
    assert zeros == (b"\xff" if fmt == F.MULAW else b"\xd5") * 100


# ---- Opus ---------------------------------------------------------------------------------


def decode_ogg(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data), format="ogg") as container:
        return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])


def decode_packets(packets: list[bytes]) -> tuple[np.ndarray, list[int]]:
    """FFmpeg's own Opus decoder, 48 kHz mono (what WebRTC's receivers decode to)."""
    dec = av.codec.CodecContext.create("opus", "r")
    dec.sample_rate, dec.layout = 48000, "mono"
    frames = [f for p in packets for f in dec.decode(av.Packet(p))]
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]), [f.samples for f in frames]


OPUS_PRE_SKIP = 312  # libopus's lookahead, 6.5 ms at 48 kHz (OpusHead's pre-skip)
# Measured on `speechlike` at 32 kbit/s: 21.5-26 dB at every rate, Ogg and packets alike.
OPUS_SNR_DB = 18


@pytest.mark.parametrize("rate", af.OPUS_RATES)
def test_opus_ogg_decodes_to_the_input(rate):
    x = speechlike(SAMPLE_RATE * 3)
    data, counts = encode_in_pieces(OutputSpec(F.OPUS_OGG, rate), x, CUTS[0])
    assert data[0].startswith(b"OggS") and b"OpusHead" in data[0]
    assert all(d.startswith(b"OggS") for d in data if d)  # every chunk is whole pages
    assert sum(counts) == len(x) * rate // SAMPLE_RATE
    got = decode_ogg(b"".join(data))
    ref = soxr.resample(x, SAMPLE_RATE, 48000)  # the decoder's rate
    # The pre-skip and the end trim in the Ogg stream give back exactly the input's length.
    assert len(got) == len(ref)
    assert snr_db(ref, got) > OPUS_SNR_DB
    # Bandwidth: 32 kbit/s (VBR) plus headers and a page a packet, an eighth of PCM16's 384.
    kbps = 8 * sum(map(len, data)) / (len(x) / SAMPLE_RATE) / 1000
    assert 35 < kbps < 55, kbps


@pytest.mark.parametrize("rate", af.OPUS_RATES)
def test_opus_packets_are_20ms_and_decode_to_the_input(rate):
    x = speechlike(SAMPLE_RATE * 3)
    data, counts = encode_in_pieces(OutputSpec(F.OPUS_PACKETS, rate), x, CUTS[1])
    packets = [p for d in data for p in af.split_packets(d)]
    n_out = len(x) * rate // SAMPLE_RATE
    frame = round(af.OPUS_FRAME_S * rate)
    # Every packet is one 20 ms frame; the last is padded, and the encoder's lookahead adds one.
    assert len(packets) == -(-(n_out + OPUS_PRE_SKIP * rate // 48000) // frame)
    got, frame_sizes = decode_packets(packets)
    assert set(frame_sizes) == {960}
    ref = soxr.resample(x, SAMPLE_RATE, 48000)
    assert snr_db(ref, got[OPUS_PRE_SKIP : OPUS_PRE_SKIP + len(ref)]) > OPUS_SNR_DB
    assert sum(counts) == n_out


@pytest.mark.parametrize("rate", [8000, 22050, 48000])
def test_mp3_decodes_to_the_input(rate):
    x = speechlike(SAMPLE_RATE * 3)
    data, counts = encode_in_pieces(OutputSpec(F.MP3, rate), x, CUTS[0])
    n_out = len(x) * rate // SAMPLE_RATE
    assert sum(counts) == n_out
    with av.open(io.BytesIO(b"".join(data)), format="mp3") as container:
        got = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    ref = soxr.resample(x, SAMPLE_RATE, rate, quality=af.RESAMPLE_QUALITY)
    assert len(got) >= af.MP3_DELAY + n_out  # whole frames, the delay first
    # Measured 25-26 dB on `speechlike` at 64 kbit/s.
    assert snr_db(ref, got[af.MP3_DELAY : af.MP3_DELAY + n_out]) > OPUS_SNR_DB
    kbps = 8 * sum(map(len, data)) / (len(x) / SAMPLE_RATE) / 1000
    assert 60 < kbps < 72, kbps


def test_split_packets_refuses_a_cut_packet():
    assert af.split_packets(b"\x02\x00ab\x01\x00c") == [b"ab", b"c"]
    with pytest.raises(ValueError, match="inside a packet"):
        af.split_packets(b"\x05\x00ab")


def test_no_encode_after_the_final_chunk():
    enc = StreamEncoder(OutputSpec(F.OPUS_OGG, 24000))
    enc.encode(np.zeros(4800, np.float32), last=True)
    with pytest.raises(RuntimeError, match="after the final chunk"):
        enc.encode(np.zeros(4800, np.float32), last=False)
    enc.close()  # harmless after the final chunk


# ---- the gateway's hook -------------------------------------------------------------------


async def test_client_audio_rewrites_responses_off_the_loop(monkeypatch):
    threads = []
    encode = StreamEncoder.encode

    def recording(self, samples, last):
        threads.append(threading.current_thread().name)
        return encode(self, samples, last)

    monkeypatch.setattr(StreamEncoder, "encode", recording)
    x = speechlike(SAMPLE_RATE * 2)
    hook = af.ClientAudio(OutputSpec(F.PCM16, 16000))
    out = []
    for seq, piece in enumerate(np.split(x, [26400])):
        msg = gateway_pb2.SynthesizeResponse(
            seq=seq,
            sample_offset=seq * 26400,
            sample_rate=SAMPLE_RATE,
            audio_format=gateway_pb2.AUDIO_FORMAT_FLOAT32,
            audio=piece.astype("<f4").tobytes(),
            num_samples=len(piece),
            is_final=seq == 1,
        )
        msg.timing.gateway_ms = 5.0
        out.append(await hook.convert(msg))
    assert all(name.startswith("audio-encode") for name in threads) and len(threads) == 2
    assert threading.current_thread().name not in threads
    assert [m.seq for m in out] == [0, 1]
    assert out[1].sample_offset == out[0].num_samples
    assert sum(m.num_samples for m in out) == len(x) * 2 // 3
    assert all(m.sample_rate == 16000 and m.audio_format == F.PCM16 for m in out)
    assert all(m.timing.gateway_ms > 5.0 for m in out)  # encoding time counted
    want = af.to_pcm16(soxr.resample(x, SAMPLE_RATE, 16000, quality=af.RESAMPLE_QUALITY))
    assert b"".join(m.audio for m in out) == want


async def test_streams_encode_concurrently_on_bounded_threads():
    specs = [OutputSpec(F.OPUS_OGG, 48000)] * (2 * af.ENCODER_THREADS + 1)
    encoders = [StreamEncoder(s) for s in specs]
    x = speechlike(SAMPLE_RATE)
    results = await asyncio.gather(*[af.encode(e, x, True) for e in encoders])
    assert len({d for d, _ in results}) == 1  # same input, same bytes, whichever thread
    assert len(af._executor()._threads) <= af.ENCODER_THREADS


def test_bench_runs_every_case(capsys):
    from bench import audio_formats

    audio_formats.main(["--seconds", "2", "--repeats", "1", "--markdown"])
    rows = [
        r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "---" not in r
    ]
    assert len(rows) == len(audio_formats.CASES) + 1  # + the header
    kbps = {tuple(r.split(" | ")[:2]): float(r.split(" | ")[-1].rstrip(" |")) for r in rows[1:]}
    assert kbps[("| PCM16", "24000")] == 384.0 and kbps[("| MULAW", "8000")] == 64.0
    assert kbps[("| OPUS_PACKETS", "48000")] < 384.0 / 5


async def test_cancelled_stream_frees_its_encoder_after_the_running_chunk(monkeypatch):
    started, release = threading.Event(), threading.Event()
    encode, close = StreamEncoder.encode, StreamEncoder.close
    events = []

    def slow(self, samples, last):
        started.set()
        release.wait(10)
        out = encode(self, samples, last)
        events.append("encoded")
        return out

    def recording_close(self):
        events.append("closed")
        close(self)

    monkeypatch.setattr(StreamEncoder, "encode", slow)
    monkeypatch.setattr(StreamEncoder, "close", recording_close)
    hook = af.ClientAudio(OutputSpec(F.OPUS_OGG, 48000))
    msg = gateway_pb2.SynthesizeResponse(audio=speechlike(24000).astype("<f4").tobytes())
    task = asyncio.ensure_future(hook.convert(msg))
    await asyncio.to_thread(started.wait, 10)
    task.cancel()  # the client went away while its chunk was being encoded
    with pytest.raises(asyncio.CancelledError):
        await task
    hook.close()
    assert events == []  # not freed under the running encode
    release.set()
    for _ in range(100):
        if len(events) == 2:
            break
        await asyncio.sleep(0.01)
    assert events == ["encoded", "closed"]
