"""The voice front end without gRPC: features against independent numpy/librosa derivations,
the resampler against a direct evaluation of its formula, the alignment rule, every refusal,
the ONNX path end to end on tiny stand-in models, and spk2info.pt in and out."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _frontend_fixtures import voiced_signal, wav_bytes, write_tiny_models

from token2wav.frontend import (
    BadAudio,
    Frontend,
    FrontendUnavailable,
    Voice,
    align,
    features,
    load_speakers,
    prompt_from_file,
    prompt_from_pcm,
    save_speakers,
)
from token2wav.frontend.resample import resample

librosa = pytest.importorskip("librosa")
sf = pytest.importorskip("soundfile")


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    return Frontend.from_dir(write_tiny_models(tmp_path_factory.mktemp("models")))


def test_mel_filters_are_librosas():
    for sr, n_fft, n_mels in ((24000, 1920, 80), (16000, 400, 128)):
        ours = features.slaney_mel_filters(sr, n_fft, n_mels).numpy()
        ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=0.0, fmax=None)
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-8)


@pytest.mark.slow
def test_prompt_log_mel_matches_librosa():
    x = voiced_signal(1.5, 24000, seed=1)
    ours = features.prompt_log_mel(torch.from_numpy(x)).numpy()
    # Independent: numpy padding, librosa's STFT (float64) and filters, the same formula.
    y = np.pad(x.astype(np.float64), (720, 720), mode="reflect")
    spec = librosa.stft(
        y,
        n_fft=1920,
        hop_length=480,
        win_length=1920,
        window="hann",
        center=False,
        dtype=np.complex128,
    )
    mag = np.sqrt(np.abs(spec) ** 2 + 1e-9)
    mel = librosa.filters.mel(sr=24000, n_fft=1920, n_mels=80, dtype=np.float64) @ mag
    ref = np.log(np.maximum(mel, 1e-5)).T
    assert ours.shape == ref.shape == (x.size // 480, 80)
    assert np.abs(ours - ref).max() < 1e-4
    # And upstream's own form of it (Matcha: float32 torch, librosa's float32 filters, the
    # magnitude through view_as_real): equal to float rounding.
    xt = torch.nn.functional.pad(torch.from_numpy(x)[None, None], (720, 720), mode="reflect")[0]
    spec = torch.view_as_real(
        torch.stft(xt, 1920, 480, 1920, torch.hann_window(1920), center=False, return_complex=True)
    )
    basis = torch.from_numpy(librosa.filters.mel(sr=24000, n_fft=1920, n_mels=80)).float()
    upstream = torch.log(torch.clamp(basis @ torch.sqrt(spec.pow(2).sum(-1) + 1e-9), min=1e-5))
    assert np.abs(ours - upstream[0].T.numpy()).max() < 1e-5


def test_whisper_log_mel_matches_librosa():
    x = voiced_signal(1.3, 16000, seed=2)
    ours = features.whisper_log_mel(torch.from_numpy(x)).numpy()
    spec = librosa.stft(
        x.astype(np.float64),
        n_fft=400,
        hop_length=160,
        window="hann",
        center=True,
        pad_mode="reflect",
        dtype=np.complex128,
    )
    power = np.abs(spec[:, :-1]) ** 2
    mel = librosa.filters.mel(sr=16000, n_fft=400, n_mels=128, dtype=np.float64) @ power
    log_spec = np.log10(np.maximum(mel, 1e-10))
    ref = (np.maximum(log_spec, log_spec.max() - 8.0) + 4.0) / 4.0
    assert ours.shape == ref.shape == (128, x.size // 160)
    assert np.abs(ours - ref).max() < 1e-4


def _kaldi_fbank_by_hand(x: np.ndarray) -> np.ndarray:
    """Kaldi's fbank written out: 25 ms frames every 10 ms (snip edges), DC removed,
    pre-emphasis 0.97, Povey window, 512-point power spectrum, 80 triangles on Kaldi's mel
    scale between 20 Hz and Nyquist, log with float epsilon floor."""
    n, shift, n_fft = 400, 160, 512
    frames = np.stack([x[i * shift : i * shift + n] for i in range(1 + (x.size - n) // shift)])
    frames = frames.astype(np.float64) - frames.mean(axis=1, keepdims=True)
    frames = np.concatenate([frames[:, :1] * (1 - 0.97), frames[:, 1:] - 0.97 * frames[:, :-1]], 1)
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / (n - 1))) ** 0.85
    power = np.abs(np.fft.rfft(frames * window, n_fft)) ** 2  # (F, 257)

    def mel(f):
        return 1127.0 * np.log(1.0 + f / 700.0)

    edges = np.linspace(mel(20.0), mel(8000.0), 82)
    bin_mel = mel(np.arange(n_fft // 2) * 16000 / n_fft)
    banks = np.zeros((80, n_fft // 2 + 1))
    for m in range(80):
        left, centre, right = edges[m : m + 3]
        up = (bin_mel - left) / (centre - left)
        down = (right - bin_mel) / (right - centre)
        inside = (bin_mel > left) & (bin_mel < right)
        banks[m, : n_fft // 2] = np.where(inside, np.where(bin_mel <= centre, up, down), 0)
    feats = np.log(np.maximum(power @ banks.T, np.finfo(np.float32).eps))
    return feats - feats.mean(axis=0, keepdims=True)


def test_kaldi_fbank_matches_hand_computed_frames():
    x = voiced_signal(1.0, 16000, seed=3)
    ours = features.kaldi_fbank(x)
    ref = _kaldi_fbank_by_hand(x)
    assert ours.shape == ref.shape == (1 + (x.size - 400) // 160, 80)
    assert np.abs(ours.mean(axis=0)).max() < 1e-4  # mean-normalised over time
    # float32 (kaldi-native-fbank) against float64: worst in the two lowest bins, which hold
    # only a few FFT bins of little energy; everywhere else near 1e-6.
    assert np.abs(ours - ref).max() < 1e-3
    assert np.median(np.abs(ours - ref)) < 1e-5


def _resample_direct(x: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """y[j] = sum_i x[i] h(i / orig - j / new), evaluated sample by sample in float64."""
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    cutoff = min(orig, new) * 0.99
    out = np.empty(math.ceil(new * x.size / orig))
    i = np.arange(x.size)
    for j in range(out.size):
        t = np.clip((i / orig - j / new) * cutoff, -6, 6)
        h = np.sinc(t) * np.cos(np.pi * t / 12) ** 2 * cutoff / orig
        out[j] = x @ h
    return out


@pytest.mark.parametrize("rates", [(44100, 24000), (48000, 16000), (16000, 24000), (22050, 16000)])
def test_resampler_equals_its_formula(rates):
    orig, new = rates
    x = voiced_signal(0.05, orig, seed=4).astype(np.float64)
    ours = resample(torch.from_numpy(x.astype(np.float32)), orig, new).numpy()
    ref = _resample_direct(x, orig, new)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 1e-5


def test_resampler_against_soxr_in_the_passband():
    """Up to 3.1 kHz our resampler (upstream's filter) and soxr VHQ agree within 1e-3 of a
    full-scale sine; near the new Nyquist upstream's short Hann-sinc filter rolls off (measured
    44.1 -> 16 kHz, RMS ratio to soxr: 1.005 at 5 kHz, 0.985 at 6 kHz, 0.815 at 7 kHz)."""
    soxr = pytest.importorskip("soxr")
    t = np.arange(44100) / 44100
    core = slice(800, 15200)  # away from the edges, where the two pad differently
    for f in (180, 950, 3100):
        x = np.sin(2 * np.pi * f * t + 1)
        ours = resample(torch.from_numpy(x.astype(np.float32)), 44100, 16000).numpy()
        ref = soxr.resample(x, 44100, 16000, quality="VHQ")
        assert np.abs(ours[core] - ref[core]).max() < 1e-3, f
    x = np.sin(2 * np.pi * 7000 * t)
    ours = resample(torch.from_numpy(x.astype(np.float32)), 44100, 16000).numpy()[core]
    assert 0.75 < np.sqrt(np.mean(ours**2) * 2) < 0.9  # upstream's roll-off, reproduced


def test_alignment_rule():
    tokens = np.arange(10)
    feat = np.zeros((17, 80), np.float32)
    t, f = align(tokens, feat)  # 17 frames -> 8 tokens, 16 frames
    assert t.tolist() == list(range(8)) and f.shape == (16, 80)
    t, f = align(tokens[:5], np.zeros((30, 80)))  # fewer tokens: frames follow them
    assert t.shape == (5,) and f.shape == (10, 80)


def test_voice_from_audio_end_to_end(frontend):
    x = voiced_signal(3.0, 44100, channels=2, seed=5)
    voice = frontend.voice_from_file(wav_bytes(x, 44100, subtype="FLOAT"))  # lossless
    n = voice.prompt_token.shape[0]
    assert n == 75 and voice.prompt_feat.shape == (150, 80) and voice.embedding.shape == (192,)
    assert (
        voice.prompt_token.dtype == np.int32
        and ((voice.prompt_token >= 0) & (voice.prompt_token < 6561)).all()
    )
    # Mix-down is the channel mean; the same samples as PCM give the same voice.
    same = frontend.voice_from_pcm(x, 44100)
    np.testing.assert_array_equal(same.prompt_token, voice.prompt_token)
    np.testing.assert_allclose(same.prompt_feat, voice.prompt_feat, atol=1e-6)
    # prompt_feat is the log-mel of the 24 kHz resampled mono mix, cut to 2N frames.
    mono24 = resample(torch.from_numpy(x.mean(axis=1)), 44100, 24000)
    np.testing.assert_allclose(
        voice.prompt_feat, features.prompt_log_mel(mono24)[: 2 * n], atol=1e-5
    )


def test_pcm_int16_and_24k_input(frontend):
    x = voiced_signal(2.0, 24000, seed=6)
    pcm16 = np.round(x * 32767).astype(np.int16)
    voice = frontend.voice_from_pcm(pcm16, 24000)
    assert voice.prompt_token.shape == (50,) and voice.prompt_feat.shape == (100, 80)


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda: wav_bytes(voiced_signal(2.0, 8000), 8000), "below the 16000 Hz minimum"),
        (lambda: wav_bytes(voiced_signal(31.0, 16000), 16000), "longer than the 30 s limit"),
        (lambda: wav_bytes(voiced_signal(0.2, 16000), 16000), "shorter than the 0.5 s minimum"),
        (lambda: wav_bytes(np.zeros(32000, np.float32), 16000), "silent"),
        (lambda: wav_bytes(1e-4 * voiced_signal(2.0, 16000), 16000), "silent"),
        (lambda: wav_bytes(voiced_signal(2.0, 16000), 16000)[:60] + b"\xff" * 7, "audio"),
        (lambda: b"this is not audio at all" * 10, "not a readable audio file"),
        (lambda: b"", "empty file"),
        (lambda: wav_bytes(voiced_signal(2.0, 16000), 16000, fmt="AIFF"), "container AIFF"),
        (lambda: wav_bytes(voiced_signal(2.0, 16000), 16000, fmt="AU"), "container AU"),
    ],
    ids=["8k", "31s", "short", "zeros", "quiet", "truncated", "garbage", "empty", "aiff", "au"],
)
def test_bad_audio_files_are_refused_with_the_problem_named(make, problem):
    with pytest.raises(BadAudio) as info:
        prompt_from_file(make(), field="audio_file")
    assert info.value.field == "audio_file" and problem in str(info.value), str(info.value)


def test_flac_and_ogg_are_read():
    x = voiced_signal(1.0, 16000, seed=7)
    for fmt in ("FLAC", "OGG"):
        audio = prompt_from_file(wav_bytes(x, 16000, fmt=fmt), "audio_file")
        assert audio.sample_rate == 16000 and abs(audio.samples.size - x.size) < 1000


def test_bad_pcm_is_refused():
    x = voiced_signal(1.0, 16000)
    cases = [
        (lambda: prompt_from_pcm(x, 0), "sample_rate"),
        (lambda: prompt_from_pcm(x.astype(np.int32), 16000), "dtype int32"),
        (lambda: prompt_from_pcm(np.where(np.arange(x.size) == 5, np.nan, x), 16000), "non-finite"),
        (lambda: prompt_from_pcm(x[None, None], 16000), "shape"),
        (lambda: prompt_from_pcm(np.stack([x, x]), 16000), "16000 channels"),
        (lambda: prompt_from_pcm(x, 44101), "no short resampling filter"),
        (lambda: prompt_from_pcm(np.zeros((5_000_000, 4), np.float32), 192000), "too much audio"),
    ]
    for call, problem in cases:
        with pytest.raises(BadAudio) as info:
            call()
        assert problem in str(info.value)


def test_missing_model_file_names_it(tmp_path):
    write_tiny_models(tmp_path)
    (tmp_path / "campplus.onnx").unlink()
    with pytest.raises(FrontendUnavailable, match="campplus.onnx not found"):
        Frontend.from_dir(tmp_path)


def test_spk2info_round_trip(frontend, tmp_path):
    a = frontend.voice_from_pcm(voiced_signal(2.0, 24000, seed=8), 24000)
    b = frontend.voice_from_pcm(voiced_signal(3.0, 16000, seed=9, f0=210), 16000)
    path = tmp_path / "spk2info.pt"
    save_speakers(path, {"alice": a, "鲍勃": b})
    raw = torch.load(path, weights_only=True)
    entry = raw["alice"]
    assert entry["flow_prompt_speech_token"].dtype == torch.int32
    assert entry["flow_prompt_speech_token"].shape == (1, 50)
    assert entry["prompt_speech_feat"].shape == (1, 100, 80)
    assert entry["flow_embedding"].shape == (1, 192)
    assert entry["prompt_speech_feat_len"].tolist() == [100]
    back = load_speakers(path)
    assert list(back) == ["alice", "鲍勃"]
    for orig, got in ((a, back["alice"]), (b, back["鲍勃"])):
        for field in ("prompt_token", "prompt_feat", "embedding"):
            np.testing.assert_array_equal(getattr(orig, field), getattr(got, field))
    assert list(load_speakers(path, ["鲍勃"])) == ["鲍勃"]
    with pytest.raises(ValueError, match="no speaker 'carol'"):
        load_speakers(path, ["carol"])


def test_upstream_style_speaker_entry_imports_aligned(tmp_path):
    """An entry as upstream's add_zero_shot_spk writes it (every model input, batch dim 1),
    here with one frame too many: imported by the alignment rule. SFT speakers (embedding
    only) are refused by name."""
    rng = np.random.default_rng(0)
    entry = {
        "prompt_text": torch.zeros(1, 7, dtype=torch.int32),
        "prompt_text_len": torch.tensor([7], dtype=torch.int32),
        "llm_prompt_speech_token": torch.randint(0, 6561, (1, 30), dtype=torch.int32),
        "flow_prompt_speech_token": torch.randint(0, 6561, (1, 30), dtype=torch.int32),
        "prompt_speech_feat": torch.from_numpy(rng.standard_normal((1, 61, 80)).astype(np.float32)),
        "llm_embedding": torch.ones(1, 192),
        "flow_embedding": torch.ones(1, 192),
    }
    path = tmp_path / "spk2info.pt"
    torch.save({"zs": entry, "sft": {"embedding": torch.ones(1, 192)}}, path)
    voice = load_speakers(path, ["zs"])["zs"]
    assert isinstance(voice, Voice)
    assert voice.prompt_token.tolist() == entry["flow_prompt_speech_token"][0].tolist()
    np.testing.assert_array_equal(voice.prompt_feat, entry["prompt_speech_feat"][0, :60].numpy())
    with pytest.raises(ValueError, match="speaker 'sft': no flow_prompt_speech_token"):
        load_speakers(path)


def test_services_start_without_the_extra_and_the_front_end_names_it(tmp_path):
    """With onnxruntime, kaldi-native-fbank and soundfile unimportable, the gateway still
    builds and the client CLI still loads; the front end and the gateway's --frontend-dir say
    which package is missing."""
    write_tiny_models(tmp_path)
    code = f"""
import sys
sys.modules.update(onnxruntime=None, kaldi_native_fbank=None, soundfile=None)
from gateway.config import GatewayConfig, build_parser
from gateway.service import GatewayService
import gateway.client.cli
GatewayService(GatewayConfig.from_args(build_parser().parse_args([])))
from token2wav.frontend import Frontend, FrontendUnavailable
try:
    Frontend.from_dir({str(tmp_path)!r})
except FrontendUnavailable as exc:
    print("FRONTEND:", exc)
from gateway.__main__ import main
main(["--frontend-dir", {str(tmp_path)!r}, "--metrics-port", "0"])
"""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr  # argparse's error exit, at start-up
    missing = "needs the Python packages onnxruntime, kaldi-native-fbank, soundfile"
    assert f"FRONTEND: the voice front end {missing}" in r.stdout
    assert "token2wav[frontend]" in r.stdout
    assert "error: --frontend-dir: the voice front end needs" in r.stderr


# Against upstream's own libraries where they are installed (not in CI: no torchaudio build for
# torch 2.13). Measured 2026-12-03 with torchaudio 2.11.1's pure-Python code and
# openai-whisper 20250625: resampling bit-identical for 8 rate pairs, Whisper log-mel within
# 1.2e-7, kaldi-native-fbank within 8.8e-4 of torchaudio's kaldi.fbank (5 s, 16 kHz).


@pytest.mark.parametrize("rates", [(44100, 24000), (48000, 16000), (16000, 24000), (22050, 16000)])
def test_resampler_equals_torchaudio_when_installed(rates):
    ta = pytest.importorskip("torchaudio")
    x = torch.from_numpy(voiced_signal(1.0, rates[0], seed=10))
    ref = ta.transforms.Resample(orig_freq=rates[0], new_freq=rates[1])(x[None])[0]
    assert torch.equal(resample(x, *rates), ref)


def test_fbank_equals_torchaudio_kaldi_when_installed():
    kaldi = pytest.importorskip("torchaudio.compliance.kaldi")
    x = torch.from_numpy(voiced_signal(2.0, 16000, seed=11))
    ref = kaldi.fbank(x[None], num_mel_bins=80, dither=0, sample_frequency=16000)
    ref = (ref - ref.mean(dim=0, keepdim=True)).numpy()
    assert np.abs(features.kaldi_fbank(x.numpy()) - ref).max() < 2e-3


def test_whisper_log_mel_equals_whisper_when_installed():
    whisper_audio = pytest.importorskip("whisper.audio")
    x = torch.from_numpy(voiced_signal(2.0, 16000, seed=12))
    ref = whisper_audio.log_mel_spectrogram(x[None], n_mels=128)[0]
    assert (features.whisper_log_mel(x) - ref).abs().max() < 1e-5
