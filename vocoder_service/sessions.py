"""One stream's session: a plain object with an id, an IntEnum status and counters.

`SessionManager` (manager.py) owns them and holds the rules; this file only says what a session
remembers and how its retry cache stays bounded.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from token2wav.errors import ServiceError
from vocoder_service.chunks import AudioChunk, MelChunk
from vocoder_service.config import SessionConfig


class SessionStatus(IntEnum):
    ACTIVE = 0  # accepting chunks
    FINALIZED = 1  # answered is_final; tombstone
    FAILED = 2  # gap timeout or broken batch; tombstone answering ABORTED
    CANCELLED = 3  # CancelSession
    EVICTED = 4  # idle timeout
    MOVED = 5  # ExportSession(remove=True)
    REPLACED = 6  # ImportSession under the same request id


@dataclass
class AppliedMelChunk:
    digest: bytes
    audio: AudioChunk | None  # None once the retry cache's byte cap dropped it


class Session:
    """One stream's vocoder state and bookkeeping. Plain object: only the event loop touches it,
    except `state`, which the runner thread advances while the session's chunk is in flight."""

    def __init__(self, request_id: str, state: Any, now: float, next_seq: int = 0):
        self.request_id = request_id
        self.status = SessionStatus.ACTIVE
        self.state = state  # HiFTSessionState; None once closed
        self.next_seq = next_seq  # lowest seq not yet applied
        self.num_frames = 0  # mel frames applied
        self.num_samples = 0  # samples emitted: the next chunk's sample_offset
        self.pending: dict[int, MelChunk] = {}  # seq -> chunk waiting for its turn
        self.pending_bytes = 0
        self.inflight: MelChunk | None = None  # the chunk in the running batch (seq == next_seq)
        self.applied: OrderedDict[int, AppliedMelChunk] = OrderedDict()  # seq -> recent answer
        self.applied_bytes = 0
        self.final_seq: int | None = None  # seq of the finalize chunk, once known
        self.error: ServiceError | None = None  # why it failed
        self.last_active = now
        self.blocked_since: float | None = None  # when an early chunk began waiting on a gap
        self.frozen = False  # an export is reading the state: do not schedule
        self.idle = asyncio.Event()  # set while no chunk is in flight
        self.idle.set()

    @property
    def nbytes(self) -> int:
        state_bytes = int(self.state.nbytes) if self.state is not None else 0
        return state_bytes + self.pending_bytes + self.applied_bytes

    def remember(self, seq: int, digest: bytes, audio: AudioChunk | None, cfg: SessionConfig):
        self.applied[seq] = AppliedMelChunk(digest, audio)
        self.applied_bytes += audio.nbytes if audio is not None else 0
        while len(self.applied) > cfg.retry_window:
            _, old = self.applied.popitem(last=False)
            self.applied_bytes -= old.audio.nbytes if old.audio is not None else 0
        # Drop audio oldest first past the byte cap, but always keep the newest answer.
        for entry in list(self.applied.values())[:-1]:
            if self.applied_bytes <= cfg.retry_cache_bytes:
                break
            if entry.audio is not None:
                self.applied_bytes -= entry.audio.nbytes
                entry.audio = None
