"""The versioned envelope of an exported session (ExportSession -> ImportSession), and what a
session's snapshot holds (`snapshot`, `restore`); SessionManager decides when a session may be
read or replaced.

Layout, all integers little-endian:
    b"T2WV" | u16 format version | u32 header length | header (UTF-8 JSON) | HiFT state bytes
    | the retry cache's audio, float32, entry after entry

The header carries the bookkeeping the service needs to continue the stream exactly (next seq,
frames and samples so far) and the retry cache (digest, offset, length of each recent answer),
so a chunk whose answer was lost in the move can be retried on the new replica. JSON, not
pickle: the bytes come from the network and must never run code.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from token2wav.errors import InvalidArgument
from vocoder_service.chunks import AudioChunk
from vocoder_service.config import SessionConfig
from vocoder_service.sessions import Session

MAGIC = b"T2WV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
MAX_RETRY_ENTRIES = 1024  # far above any sane retry window; bounds a forged header


@dataclass(frozen=True)
class RetryEntry:
    seq: int
    digest: bytes  # 16-byte chunk digest
    sample_offset: int
    is_final: bool
    audio: np.ndarray | None  # (S,) float32; None when only the digest was kept


@dataclass(frozen=True)
class SessionSnapshot:
    model_tag: str  # which model wrote the state (preset); import refuses another
    next_seq: int
    num_frames: int
    num_samples: int
    state: bytes  # HiFTSessionState.to_bytes()
    applied: list[RetryEntry] = field(default_factory=list)


def pack_session(snap: SessionSnapshot) -> bytes:
    blobs = [
        np.ascontiguousarray(e.audio, dtype="<f4").tobytes()
        for e in snap.applied
        if e.audio is not None
    ]
    header = {
        "model_tag": snap.model_tag,
        "next_seq": snap.next_seq,
        "num_frames": snap.num_frames,
        "num_samples": snap.num_samples,
        "state_bytes": len(snap.state),
        "applied": [
            {
                "seq": e.seq,
                "digest": e.digest.hex(),
                "sample_offset": e.sample_offset,
                "is_final": e.is_final,
                "num_audio": -1 if e.audio is None else int(e.audio.shape[0]),
            }
            for e in snap.applied
        ],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)), head, snap.state, *blobs])


def _bad(problem: str) -> InvalidArgument:
    return InvalidArgument("state", problem)


def _count(header: dict, key: str) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _bad(f"header field {key!r} is not a non-negative integer")
    return value


def unpack_session(blob: bytes, model_tag: str) -> SessionSnapshot:
    """Parse and check an envelope; every failure is INVALID_ARGUMENT naming `state`."""
    if len(blob) < _PREFIX.size:
        raise _bad(f"{len(blob)} bytes is shorter than the {_PREFIX.size}-byte envelope prefix")
    magic, version, head_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise _bad("not an exported vocoder session (bad magic)")
    if version != FORMAT_VERSION:
        raise _bad(f"format version {version}; this replica reads version {FORMAT_VERSION}")
    pos = _PREFIX.size + head_len
    if pos > len(blob):
        raise _bad("truncated header")
    try:
        header = json.loads(blob[_PREFIX.size : pos].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _bad("header is not a JSON object")
    if header.get("model_tag") != model_tag:
        raise _bad(
            f"exported by model {header.get('model_tag')!r}; this replica runs {model_tag!r}"
        )
    next_seq, state_len = _count(header, "next_seq"), _count(header, "state_bytes")
    state = blob[pos : pos + state_len]
    pos += state_len
    entries = header.get("applied")
    if not isinstance(entries, list) or len(entries) > MAX_RETRY_ENTRIES:
        raise _bad("header field 'applied' is not a list of at most 1024 entries")
    applied = []
    for e in entries:
        if not isinstance(e, dict):
            raise _bad("retry entry is not an object")
        seq, offset = _count(e, "seq"), _count(e, "sample_offset")
        n = e.get("num_audio")
        digest = e.get("digest")
        if seq >= next_seq or not isinstance(n, int) or n < -1 or not isinstance(digest, str):
            raise _bad(f"retry entry for seq {seq} is malformed")
        try:
            digest_bytes = bytes.fromhex(digest)
        except ValueError:
            raise _bad(f"retry entry for seq {seq}: digest is not hex") from None
        audio = None
        if n >= 0:
            if pos + 4 * n > len(blob):
                raise _bad("truncated retry audio")
            audio = np.frombuffer(blob, dtype="<f4", count=n, offset=pos).astype(np.float32)
            pos += 4 * n
        applied.append(RetryEntry(seq, digest_bytes, offset, bool(e.get("is_final")), audio))
    if pos != len(blob):
        raise _bad(f"{len(blob)} bytes, but the header accounts for {pos}")
    return SessionSnapshot(
        model_tag,
        next_seq,
        _count(header, "num_frames"),
        _count(header, "num_samples"),
        state,
        applied,
    )


def snapshot(s: Session, model_tag: str) -> SessionSnapshot:
    """What continues `s` on another replica: its HiFT state, counts and retry cache."""
    return SessionSnapshot(
        model_tag=model_tag,
        next_seq=s.next_seq,
        num_frames=s.num_frames,
        num_samples=s.num_samples,
        state=s.state.to_bytes(),
        applied=[
            RetryEntry(seq, e.digest, e.audio.sample_offset, e.audio.is_final, e.audio.audio)
            if e.audio is not None
            else RetryEntry(seq, e.digest, 0, False, None)
            for seq, e in s.applied.items()
        ],
    )


def check_state(state, snap: SessionSnapshot) -> None:
    """The loaded HiFT state must be where the envelope says the stream is, and not final."""
    emitted = getattr(state, "num_samples_emitted", snap.num_samples)
    finalized = getattr(state, "finalized", False)
    if emitted != snap.num_samples or finalized:
        raise InvalidArgument(
            "state",
            f"HiFT state at sample {emitted} (finalized={finalized}), envelope says "
            f"{snap.num_samples}",
        )


def restore(s: Session, snap: SessionSnapshot, config: SessionConfig) -> None:
    """Give a session just opened from `snap`'s state the snapshot's counts and retry cache."""
    s.num_frames, s.num_samples = snap.num_frames, snap.num_samples
    for e in snap.applied:
        audio = None
        if e.audio is not None:
            audio = AudioChunk(s.request_id, e.seq, e.sample_offset, e.audio, e.is_final)
        s.remember(e.seq, e.digest, audio, config)
