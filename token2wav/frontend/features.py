"""The three feature extractors of upstream's front end (docs/REFERENCE.md §1.3, §1.4).

Dimensions: L samples, F frames, M mel bins.

- `prompt_log_mel`: the flow's prompt_feat (Matcha `mel_spectrogram` with CosyVoice3's settings)
  at 24 kHz: reflect-pad (n_fft - hop) / 2 each side, STFT without centring, magnitude
  sqrt(re^2 + im^2 + 1e-9), Slaney mel, natural log of max(mel, 1e-5).
- `whisper_log_mel`: the speech tokenizer's input (Whisper's `log_mel_spectrogram`, 128 bins) at
  16 kHz: centred reflect-padded STFT, last frame dropped, power, Slaney mel, log10 of
  max(mel, 1e-10), floored at (max - 8), then (x + 4) / 4.
- `kaldi_fbank`: CAM++'s input: Kaldi fbank (kaldi-native-fbank; 25 ms Povey window, 10 ms hop,
  80 bins, dither 0, the rest Kaldi's defaults as torchaudio's `compliance.kaldi.fbank` has them),
  minus its mean over time.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from token2wav.frontend.audio import require

PROMPT_RATE = 24000
PROMPT_N_FFT = 1920
PROMPT_HOP = 480  # 20 ms: 50 frames per second
PROMPT_MELS = 80
WHISPER_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160  # 10 ms: 100 frames per second
WHISPER_MELS = 128
FBANK_BINS = 80


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mel per 200 Hz), logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    linear = f / (200.0 / 3)
    log_part = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (math.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log_part, linear)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    linear = m * (200.0 / 3)
    log_part = 1000.0 * np.exp((math.log(6.4) / 27.0) * (m - 15.0))
    return np.where(m >= 15.0, log_part, linear)


@lru_cache(maxsize=8)
def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """(M, n_fft // 2 + 1) float32 triangular filters, fmin 0, fmax Nyquist, each scaled to
    unit area (Slaney norm): the filters librosa.filters.mel builds with its defaults."""
    bins = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    widths = np.diff(edges)
    rising = (bins[None, :] - edges[:-2, None]) / widths[:-1, None]
    falling = (edges[2:, None] - bins[None, :]) / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(weights.astype(np.float32))


def prompt_log_mel(audio_24k: torch.Tensor) -> torch.Tensor:
    """(L,) float32 at 24 kHz -> (F, 80) log-mel, F = floor((L - 480) / 480) + 1."""
    pad = (PROMPT_N_FFT - PROMPT_HOP) // 2
    x = torch.nn.functional.pad(audio_24k[None, None], (pad, pad), mode="reflect")[0]  # (1, L')
    spec = torch.stft(
        x,
        PROMPT_N_FFT,
        hop_length=PROMPT_HOP,
        win_length=PROMPT_N_FFT,
        window=torch.hann_window(PROMPT_N_FFT),
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )[0]  # (n_fft/2 + 1, F)
    magnitude = torch.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
    mel = slaney_mel_filters(PROMPT_RATE, PROMPT_N_FFT, PROMPT_MELS) @ magnitude  # (M, F)
    return torch.log(torch.clamp(mel, min=1e-5)).T.contiguous()  # (F, M)


def whisper_log_mel(audio_16k: torch.Tensor) -> torch.Tensor:
    """(L,) float32 at 16 kHz -> (128, F) normalised log-mel, F = L // 160."""
    spec = torch.stft(
        audio_16k,
        WHISPER_N_FFT,
        hop_length=WHISPER_HOP,
        window=torch.hann_window(WHISPER_N_FFT),
        center=True,
        pad_mode="reflect",
        return_complex=True,
    )  # (n_fft/2 + 1, F + 1)
    power = spec[:, :-1].abs() ** 2
    mel = slaney_mel_filters(WHISPER_RATE, WHISPER_N_FFT, WHISPER_MELS) @ power  # (M, F)
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def kaldi_fbank(audio_16k: np.ndarray) -> np.ndarray:
    """(L,) float32 at 16 kHz, in [-1, 1] as upstream feeds it -> (F, 80) float32, mean over
    time removed. F = 1 + (L - 400) // 160 (Kaldi's snip_edges)."""
    knf = require("kaldi_native_fbank", "kaldi-native-fbank")
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.samp_freq = WHISPER_RATE
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = FBANK_BINS
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(WHISPER_RATE, np.ascontiguousarray(audio_16k, dtype=np.float32))
    fbank.input_finished()
    feats = np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])
    feats = feats.astype(np.float32)
    return feats - feats.mean(axis=0, keepdims=True)
