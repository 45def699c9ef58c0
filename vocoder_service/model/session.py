"""Per-stream HiFT session state (a plain object, no module references) and chunk planning.

A session remembers only what the next chunk needs: the mel tail that the decoder window and
the f0 predictor will re-read, the frozen f0 values and phase (in cycles) of the frames the
window will re-synthesise, the phase carry, and counters. Everything is indexed by absolute mel
frame, so its size does not depend on how long the stream has run (see `decode_window`).

Serialised form (`to_bytes`), little-endian:
    b"T2WHIFT\\0" | u32 version | u32 header length | header JSON (utf-8) | mel f32 | f0 f64 |
    phase f64 | phase_carry f64
The header holds the counters, the array shapes and the model fingerprint.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import torch

from token2wav import SAMPLES_PER_FRAME
from token2wav.invalid import InvalidInput
from vocoder_service.model.config import F0_LOOK_RIGHT, HOLDBACK_FRAMES, HiFTConfig

MAGIC = b"T2WHIFT\0"
STATE_VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
MAX_HEADER_BYTES = 4096


def model_fingerprint(cfg: HiFTConfig) -> str:
    """What a session's saved arrays depend on; a session only continues on a matching model."""
    return (
        f"hift:mel{cfg.in_channels}:h{cfg.num_harmonics}:seed{cfg.noise_seed}"
        f":ctx{cfg.context_frames()}:f0ctx{cfg.f0_context_frames}:phase-{cfg.phase_mode}"
    )


@dataclass
class DecodeWindow:
    """Frame bookkeeping for one chunk of one session; all indices are absolute mel frames."""

    total: int  # frames received after this chunk (T')
    finalize: bool
    f0_new: tuple[int, int]  # f0 frames computed now, [F, F')
    f0_mel: tuple[int, int]  # mel frames the f0 predictor reads (zero-padded to F' + 3)
    out: tuple[int, int]  # frames whose 480 samples are emitted now
    window: int  # w0: first frame of the decoder window
    dec_end: int  # conv_pre outputs frames [w0, dec_end); it reads mel up to dec_end + 4
    src_end: int  # source synthesised for frames [w0, src_end)
    keep_mel_from: int  # state trimming after the chunk
    keep_f0_from: int

    @property
    def num_out_samples(self) -> int:
        return (self.out[1] - self.out[0]) * SAMPLES_PER_FRAME


class HiFTSessionState:
    """One stream's vocoder state. Create with `HiFTGenerator.new_session()`; advance only
    through `HiFTGenerator.decode_batch` (which validates first and updates the state only on success)."""

    def __init__(self, fingerprint: str, in_channels: int, num_harmonics: int):
        self.fingerprint = fingerprint
        self.num_frames = 0  # mel frames received
        self.num_samples_emitted = 0
        self.num_f0_frames = 0  # frames whose f0 (and phase) is computed and frozen
        self.finalized = False
        self.mel = torch.zeros(in_channels, 0)  # (c, t): frames [num_frames - t, num_frames)
        self.f0 = torch.zeros(0, dtype=torch.float64)  # [t_f0]: frames [num_f0_frames - t_f0, ...)
        # Per-frame phase state (t_f0, m), float64 cycles (SourceModule.advance_phase), and the
        # carry [m]: the state of frame F - 1 (0 before the first frame).
        self.phase = torch.zeros(0, num_harmonics, dtype=torch.float64)
        self.phase_carry = torch.zeros(num_harmonics, dtype=torch.float64)

    @property
    def mel_start(self) -> int:
        return self.num_frames - self.mel.shape[1]

    @property
    def f0_start(self) -> int:
        return self.num_f0_frames - self.f0.shape[0]

    @property
    def num_frames_emitted(self) -> int:
        return self.num_samples_emitted // SAMPLES_PER_FRAME

    @property
    def nbytes(self) -> int:
        """Approximate memory held (arrays plus a fixed allowance for the object)."""
        arrays = (self.mel, self.f0, self.phase, self.phase_carry)
        return sum(a.numel() * a.element_size() for a in arrays) + 256

    def __repr__(self) -> str:
        return (
            f"HiFTSessionState(frames={self.num_frames}, emitted={self.num_samples_emitted}, "
            f"f0_frames={self.num_f0_frames}, finalized={self.finalized}, nbytes={self.nbytes})"
        )

    # -- serialisation ---------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        header = {
            "fingerprint": self.fingerprint,
            "num_frames": self.num_frames,
            "num_samples_emitted": self.num_samples_emitted,
            "num_f0_frames": self.num_f0_frames,
            "finalized": self.finalized,
            "mel_shape": list(self.mel.shape),
            "f0_len": self.f0.shape[0],
            "num_harmonics": self.phase.shape[1],
        }
        head = json.dumps(header, sort_keys=True).encode()
        parts = [
            _PREFIX.pack(MAGIC, STATE_VERSION, len(head)),
            head,
            self.mel.numpy().astype("<f4").tobytes(),
            self.f0.numpy().astype("<f8").tobytes(),
            self.phase.numpy().astype("<f8").tobytes(),
            self.phase_carry.numpy().astype("<f8").tobytes(),
        ]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> HiFTSessionState:
        """Inverse of `to_bytes`; raises InvalidInput(field="session") on anything malformed."""
        try:
            return cls._parse(bytes(data))
        except InvalidInput:
            raise
        except Exception as exc:  # struct, json, numpy and key errors all mean a bad blob
            raise InvalidInput("session", f"malformed state bytes ({exc})") from None

    @classmethod
    def _parse(cls, data: bytes) -> HiFTSessionState:
        if len(data) < _PREFIX.size:
            raise InvalidInput("session", f"state is {len(data)} bytes, too short")
        magic, version, head_len = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise InvalidInput("session", "not a HiFT session state (bad magic)")
        if version != STATE_VERSION:
            raise InvalidInput("session", f"state version {version}, expected {STATE_VERSION}")
        if head_len > MAX_HEADER_BYTES:
            raise InvalidInput("session", f"header of {head_len} bytes")
        pos = _PREFIX.size
        h = json.loads(data[pos : pos + head_len].decode())
        pos += head_len
        c, t = (int(v) for v in h["mel_shape"])
        t_f0, m = int(h["f0_len"]), int(h["num_harmonics"])
        counts = (c * t, t_f0, t_f0 * m, m)
        itemsizes = (4, 8, 8, 8)
        expected = pos + sum(n * size for n, size in zip(counts, itemsizes))
        if len(data) != expected:
            raise InvalidInput("session", f"state is {len(data)} bytes, header implies {expected}")
        arrays = []
        for count, size in zip(counts, itemsizes):
            dtype = np.dtype("<f4" if size == 4 else "<f8")
            arrays.append(np.frombuffer(data, dtype=dtype, count=count, offset=pos).copy())
            pos += count * size
        st = cls(str(h["fingerprint"]), c, m)
        st.num_frames = int(h["num_frames"])
        st.num_samples_emitted = int(h["num_samples_emitted"])
        st.num_f0_frames = int(h["num_f0_frames"])
        st.finalized = bool(h["finalized"])
        st.mel = torch.from_numpy(arrays[0].astype(np.float32).reshape(c, t))
        st.f0 = torch.from_numpy(arrays[1].astype(np.float64))
        st.phase = torch.from_numpy(arrays[2].astype(np.float64).reshape(t_f0, m))
        st.phase_carry = torch.from_numpy(arrays[3].astype(np.float64))
        st._check_consistent()
        return st

    def _check_consistent(self) -> None:
        ok = (
            0 <= self.mel_start <= self.num_frames
            and 0 <= self.f0_start <= self.num_f0_frames <= self.num_frames
            and self.num_samples_emitted % SAMPLES_PER_FRAME == 0
            and self.num_frames_emitted <= self.num_frames
            and bool(torch.isfinite(self.mel).all())
            and bool(torch.isfinite(self.phase).all() and torch.isfinite(self.f0).all())
        )
        if not ok:
            raise InvalidInput("session", "inconsistent counters or non-finite arrays in state")


def decode_window(
    st: HiFTSessionState, n_new: int, finalize: bool, cfg: HiFTConfig
) -> DecodeWindow:
    """Which frames a chunk of `n_new` mel frames reads, computes and emits.

    Upstream semantics (docs/REFERENCE.md §5.5-5.6): with T frames and no finalize, f0 exists for T-3 frames
    (the last 3 are conv0's right context), conv_pre outputs T-7 frames (4 more of context) and
    the last frame of that is dropped, so audio reaches frame T-8; with finalize everything up
    to T is emitted against zero right padding. The decoder re-runs on frames [w0, ...) with
    w0 = first new output frame - context_frames; outputs before the new ones are discarded.
    """
    total = st.num_frames + n_new
    f0_end = total if finalize else max(0, total - F0_LOOK_RIGHT)
    f0_lo = max(0, st.num_f0_frames - cfg.f0_context_frames)
    out_from = st.num_frames_emitted
    out_to = total if finalize else max(out_from, total - HOLDBACK_FRAMES)
    ctx = cfg.context_frames()
    window = max(0, out_from - ctx)
    dec_end = total if finalize else out_to + 1
    src_end = total if finalize else dec_end + 1
    next_window = max(0, out_to - ctx)
    next_f0_lo = max(0, f0_end - cfg.f0_context_frames)
    return DecodeWindow(
        total=total,
        finalize=finalize,
        f0_new=(st.num_f0_frames, f0_end),
        f0_mel=(f0_lo, min(total, f0_end + F0_LOOK_RIGHT)),
        out=(out_from, out_to),
        window=window,
        dec_end=dec_end,
        src_end=src_end,
        keep_mel_from=min(next_window, next_f0_lo),
        keep_f0_from=next_window,
    )
