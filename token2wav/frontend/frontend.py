"""Prompt audio -> Voice, the way upstream's `frontend_zero_shot` makes one.

Dimensions: N prompt tokens (25 Hz), 2N prompt mel frames (50 Hz).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from token2wav import MEL_BINS, SPK_EMBED_DIM, TOKEN_MEL_RATIO, VOCAB_SIZE
from token2wav.frontend import features
from token2wav.frontend.audio import (
    BadAudio,
    PromptAudio,
    prompt_from_file,
    prompt_from_pcm,
    require_all,
)
from token2wav.frontend.models import (
    SPEAKER_FILE,
    TOKENIZER_FILE,
    ModelOutputError,
    SpeakerEncoder,
    SpeechTokenizer,
)
from token2wav.frontend.resample import resample


@dataclass(frozen=True)
class Voice:
    """The three arrays a voice is (the gateway validates them again as any voice)."""

    prompt_token: np.ndarray  # [N] int32, ids in 0..6560
    prompt_feat: np.ndarray  # [2N, 80] float32 log-mel
    embedding: np.ndarray  # [192] float32 CAM++ x-vector

    def save_npz(self, path: str | Path) -> None:
        np.savez(
            path,
            prompt_token=self.prompt_token,
            prompt_feat=self.prompt_feat,
            embedding=self.embedding,
        )


def align(tokens: np.ndarray, feat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Upstream's rule for 24 kHz models: N = min(floor(frames / 2), tokens); keep the first N
    tokens and the first 2N frames."""
    n = min(feat.shape[0] // TOKEN_MEL_RATIO, tokens.shape[0])
    return tokens[:n], feat[: TOKEN_MEL_RATIO * n]


@dataclass(frozen=True)
class FrontendConfig:
    model_dir: Path  # holds speech_tokenizer_v3.onnx and campplus.onnx
    num_threads: int = 1  # onnxruntime intra-op threads per model, as upstream


class Frontend:
    """Thread-safe: onnxruntime sessions may run concurrently, everything else is local."""

    def __init__(self, config: FrontendConfig):
        require_all()  # fail at start, naming every missing package, not on first use
        d = Path(config.model_dir)
        self.config = config
        self.tokenizer = SpeechTokenizer(d / TOKENIZER_FILE, config.num_threads)
        self.speaker = SpeakerEncoder(d / SPEAKER_FILE, config.num_threads)

    @classmethod
    def from_dir(cls, model_dir: str | Path, num_threads: int = 1) -> Frontend:
        return cls(FrontendConfig(Path(model_dir), num_threads))

    def voice_from_file(self, data: bytes, field: str = "audio") -> Voice:
        return self.make_voice(prompt_from_file(data, field), field)

    def voice_from_pcm(self, samples, sample_rate: int, field: str = "audio") -> Voice:
        return self.make_voice(prompt_from_pcm(samples, sample_rate, field), field)

    def make_voice(self, audio: PromptAudio, field: str = "audio") -> Voice:
        with torch.inference_mode():
            x = torch.from_numpy(audio.samples)
            x24 = resample(x, audio.sample_rate, features.PROMPT_RATE)
            x16 = resample(x, audio.sample_rate, features.WHISPER_RATE)
            feat = features.prompt_log_mel(x24).numpy()  # (2N', 80)
            mel16 = features.whisper_log_mel(x16).numpy()  # (128, F)
        tokens = self.tokenizer(mel16)
        bad = np.flatnonzero((tokens < 0) | (tokens >= VOCAB_SIZE))
        if bad.size:
            raise ModelOutputError(
                f"speech tokenizer gave id {int(tokens[bad[0]])} outside 0..{VOCAB_SIZE - 1}"
            )
        embedding = self.speaker(features.kaldi_fbank(x16.numpy()))
        if embedding.shape != (SPK_EMBED_DIM,):
            raise ModelOutputError(
                f"speaker encoder gave {embedding.shape[0]} values, want {SPK_EMBED_DIM}"
            )
        tokens, feat = align(tokens, feat)
        if tokens.shape[0] == 0:
            raise BadAudio(field, "too short to give a single prompt token")
        assert feat.shape == (TOKEN_MEL_RATIO * tokens.shape[0], MEL_BINS)
        return Voice(tokens.astype(np.int32), feat.astype(np.float32), embedding)
