"""Prompt audio in: decode a WAV/FLAC/OGG file or take PCM, mix down to mono, refuse what
upstream's front end cannot use.

Every refusal is a `BadAudio` naming the field and the problem; it is a `ValueError` with a
`.field`, which the gRPC edge answers with INVALID_ARGUMENT (this package imports no grpc).
"""

from __future__ import annotations

import importlib
import io
from dataclasses import dataclass

import numpy as np

from token2wav.frontend.resample import MAX_KERNEL_ELEMENTS, kernel_elements

MIN_SAMPLE_RATE = 16000  # upstream's load_wav refuses to resample from below 16 kHz
MAX_SAMPLE_RATE = 384000  # beyond any real recording; bounds the resampling kernel
MAX_PROMPT_SECONDS = 30.0  # upstream's speech tokenizer refuses longer prompts
MAX_CHANNELS = 32
MAX_DECODED_SAMPLES = 16_000_000  # frames x channels: 64 MB of float32 at most per recording
TARGET_RATES = (24000, 16000)  # the front end resamples to both
MIN_PROMPT_SECONDS = 0.5  # 12 prompt tokens; below this a prompt carries no usable voice
SILENCE_PEAK = 1e-3  # -60 dBFS: a prompt whose loudest sample is below this is silence
CONTAINERS = ("WAV", "WAVEX", "RF64", "FLAC", "OGG")  # libsndfile format names we accept
_EXTRA_HINT = "pip install 'token2wav[frontend]'"


class BadAudio(ValueError):
    """The prompt audio cannot make a voice. `field` names the request field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class FrontendUnavailable(RuntimeError):
    """The front end cannot run here: a package or a model file is missing (a deployment
    problem, not the client's)."""


def require(module: str, package: str | None = None):
    """Import an optional dependency of the front end, or say which package is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise FrontendUnavailable(
            f"the voice front end needs the Python package {package or module} ({_EXTRA_HINT}): "
            f"{exc}"
        ) from None


EXTRA_PACKAGES = {  # module -> PyPI package of the `frontend` extra
    "onnxruntime": "onnxruntime",
    "kaldi_native_fbank": "kaldi-native-fbank",
    "soundfile": "soundfile",
}


def require_all() -> None:
    """Raise FrontendUnavailable listing every package of the extra that cannot be imported."""
    missing = []
    for module, package in EXTRA_PACKAGES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise FrontendUnavailable(
            f"the voice front end needs the Python packages {', '.join(missing)} ({_EXTRA_HINT})"
        )


@dataclass(frozen=True)
class PromptAudio:
    """Validated mono prompt audio at its own sample rate."""

    samples: np.ndarray  # [num_samples] float32, nominally in [-1, 1]
    sample_rate: int

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / self.sample_rate


def _check_rate_and_length(
    field: str, sample_rate: int, num_frames: int, num_channels: int = 1
) -> None:
    if sample_rate < MIN_SAMPLE_RATE:
        raise BadAudio(
            field, f"sample rate {sample_rate} Hz is below the {MIN_SAMPLE_RATE} Hz minimum"
        )
    if sample_rate > MAX_SAMPLE_RATE:
        raise BadAudio(field, f"sample rate {sample_rate} Hz is above {MAX_SAMPLE_RATE} Hz")
    if any(kernel_elements(sample_rate, r) > MAX_KERNEL_ELEMENTS for r in TARGET_RATES):
        raise BadAudio(
            field,
            f"sample rate {sample_rate} Hz has no short resampling filter to 24 and 16 kHz; "
            "use a common rate (16000, 22050, 24000, 32000, 44100, 48000, 96000 Hz)",
        )
    if num_channels > MAX_CHANNELS:
        raise BadAudio(field, f"{num_channels} channels (at most {MAX_CHANNELS})")
    if num_frames * num_channels > MAX_DECODED_SAMPLES:
        raise BadAudio(field, f"{num_frames} frames x {num_channels} channels is too much audio")
    seconds = num_frames / sample_rate
    if seconds > MAX_PROMPT_SECONDS:
        raise BadAudio(
            field, f"{seconds:.2f} s of audio is longer than the {MAX_PROMPT_SECONDS:g} s limit"
        )
    if seconds < MIN_PROMPT_SECONDS:
        raise BadAudio(
            field, f"{seconds:.3f} s of audio is shorter than the {MIN_PROMPT_SECONDS:g} s minimum"
        )


def prompt_from_pcm(samples, sample_rate: int, field: str = "audio") -> PromptAudio:
    """PCM as (num_samples,) or (num_samples, channels): int16 (full scale 32768) or float."""
    x = np.asarray(samples)
    if x.ndim not in (1, 2) or x.size == 0:
        raise BadAudio(field, f"want (samples,) or (samples, channels) PCM, got shape {x.shape}")
    if x.ndim == 2 and x.shape[1] > MAX_CHANNELS:
        raise BadAudio(field, f"{x.shape[1]} channels; want (samples, channels) order")
    if x.dtype == np.int16:
        x = x.astype(np.float32) / 32768.0
    elif x.dtype.kind == "f":
        x = x.astype(np.float32)
    else:
        raise BadAudio(field, f"PCM dtype {x.dtype} not supported (want int16 or float32)")
    if not int(sample_rate) > 0:
        raise BadAudio(f"{field}.sample_rate", "required (Hz)")
    _check_rate_and_length(field, int(sample_rate), x.shape[0], x.shape[1] if x.ndim == 2 else 1)
    if not np.isfinite(x).all():
        raise BadAudio(field, "non-finite sample")
    mono = x.mean(axis=1) if x.ndim == 2 else x  # upstream: mean over channels
    peak = float(np.abs(mono).max())
    if peak < SILENCE_PEAK:
        raise BadAudio(field, f"silent (peak {20 * np.log10(max(peak, 1e-12)):.1f} dBFS)")
    return PromptAudio(np.ascontiguousarray(mono, dtype=np.float32), int(sample_rate))


def prompt_from_file(data: bytes, field: str = "audio") -> PromptAudio:
    """Decode the bytes of a WAV, FLAC or OGG file (what libsndfile reads)."""
    sf = require("soundfile")
    if not data:
        raise BadAudio(field, "empty file")
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - libsndfile's errors have no common base
        raise BadAudio(field, f"not a readable audio file ({_one_line(exc)})") from None
    if info.format not in CONTAINERS:
        raise BadAudio(field, f"container {info.format} is not supported (want WAV, FLAC or OGG)")
    # Refuse by the header before decoding, so a long file costs no memory.
    _check_rate_and_length(field, int(info.samplerate), int(info.frames), int(info.channels))
    try:
        x, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # noqa: BLE001
        raise BadAudio(field, f"corrupt audio data ({_one_line(exc)})") from None
    if x.shape[0] == 0:
        raise BadAudio(field, "no audio samples in the file")
    return prompt_from_pcm(x, sr, field)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__
