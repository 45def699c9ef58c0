"""The plain objects that flow between servicer, session manager, batcher and runner.

A `MelChunk` is one validated VocoderChunk; an `AudioChunk` is the answer to it. Neither knows gRPC
or torch; mel and audio are numpy arrays (the runner moves them to the device).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def mel_chunk_digest(mel: np.ndarray, finalize: bool) -> bytes:
    """What makes two chunks under one seq "the same": frames, values and the finalize flag."""
    data = np.ascontiguousarray(mel, dtype="<f4").tobytes()
    return mel_digest(int(mel.shape[1]), data, finalize)


def mel_digest(num_frames: int, data: bytes, finalize: bool) -> bytes:
    """`mel_chunk_digest` of a mel given as its little-endian float32 bytes (as on the wire)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{num_frames}:{int(finalize)}:".encode())
    h.update(data)
    return h.digest()


@dataclass(eq=False)
class MelChunk:
    """One chunk of mel for one session, on its way to being applied."""

    request_id: str
    seq: int
    mel: np.ndarray  # (80, F) float32, F >= 1 unless finalize
    finalize: bool
    digest: bytes = b""
    arrival: float = field(default_factory=time.monotonic)
    ready_at: float = 0.0  # when it became the next applicable chunk of its session
    future: asyncio.Future | None = None  # -> AudioChunk; shared by duplicates of this seq
    session: Any = None  # the sessions.Session it was admitted to (no import: no circle)
    due: float = math.inf  # playback deadline on the manager's clock (from slack_ms); inf: none

    def __post_init__(self):
        if not self.digest:
            self.digest = mel_chunk_digest(self.mel, self.finalize)

    @property
    def num_frames(self) -> int:
        return int(self.mel.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.mel.nbytes)


@dataclass(frozen=True)
class AudioChunk:
    """The answer to one chunk: samples [sample_offset, sample_offset + len(audio))."""

    request_id: str
    seq: int
    sample_offset: int
    audio: np.ndarray  # (S,) float32
    is_final: bool
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    batch_size: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.audio.nbytes)
