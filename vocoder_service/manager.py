"""`SessionManager`: sessions keyed by request id, chunks admitted and applied in seq order.

Rules (the contract in protos/token2wav/v1/vocoder.proto, made precise):
  * seq 0 of an unknown request id opens a session (cap -> RESOURCE_EXHAUSTED); any other seq
    of an unknown id -> NOT_FOUND (never opened, evicted idle, cancelled or moved away). So seq 0
    must arrive first; reordering applies from then on. A replica that lost a session (restart,
    eviction) thus says so at once instead of holding later chunks until a gap timeout.
  * Chunks apply strictly in seq order, one at a time per session. An early chunk waits in the
    reorder buffer: at most `reorder_window` seqs ahead and `reorder_bytes` of mel, else
    RESOURCE_EXHAUSTED. A gap not filled within `gap_timeout_s` fails the session: its waiting
    chunks and every later chunk get ABORTED.
  * A duplicate of a waiting or running seq shares its answer; of an applied seq within the
    last `retry_window` chunks gets the same audio again, the state untouched. A different
    payload under a known seq, or a duplicate older than the retry window -> ABORTED; the
    session itself goes on (its state is intact, and the first payload stands).
  * finalize: the answer carries is_final and the session closes; it stays as a tombstone for
    `idle_timeout_s`, answering retries of its last chunks, and ABORTED for any seq after the end.
  * No chunk for `idle_timeout_s` (and none waiting or running), and no open transport stream
    that has sent chunks for it: evicted; NOT_FOUND after. A caller that keeps its stream open
    is waiting for work upstream (a busy flow service), not gone; idle time counts from the
    stream's end.
  * The transport stream is not the session: breaking it drops nothing here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from token2wav import MAX_FRAMES
from token2wav.errors import (
    Aborted,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    check_request_id,
)
from vocoder_service import metrics
from vocoder_service.batch_policy import batch_order, fits
from vocoder_service.chunks import AudioChunk, MelChunk
from vocoder_service.config import SessionConfig
from vocoder_service.export import SessionSnapshot, check_state, restore, snapshot
from vocoder_service.sessions import Session, SessionStatus

logger = logging.getLogger(__name__)


def _silence(fut: asyncio.Future) -> None:
    # A chunk's waiter may be gone (its transport stream broke); mark the outcome as seen.
    if not fut.cancelled():
        fut.exception()


class SessionManager:
    """Owns all sessions: admission, reorder buffer, retries, timeouts, cap, export/import.

    `new_state()` makes a fresh HiFT state; `load_state(bytes)` rebuilds an exported one.
    The batcher drives it with `wait_ready` / `take_ready` / `complete` / `reject`.
    """

    def __init__(
        self,
        config: SessionConfig,
        new_state: Callable[[], Any],
        load_state: Callable[[bytes], Any],
        *,
        model_tag: str = "",
        max_session_frames: int = MAX_FRAMES,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self._new_state = new_state
        self._load_state = load_state
        self.model_tag = model_tag  # exported states only import into the same model
        self.max_session_frames = max_session_frames
        self.clock = clock
        self._active: dict[str, Session] = {}  # request_id -> open session
        self._closed: OrderedDict[str, Session] = OrderedDict()  # request_id -> tombstone
        self._ready: OrderedDict[str, Session] = OrderedDict()  # request_id -> runnable, FIFO
        self._ready_event = asyncio.Event()
        self._streams: dict[str, int] = {}  # request_id -> open transport streams that used it

    # -- admission -----------------------------------------------------------------------------

    def submit(self, chunk: MelChunk) -> asyncio.Future:
        """Admit one validated chunk; returns the future of its AudioChunk, or raises."""
        cfg, now, rid, seq = self.config, self.clock(), chunk.request_id, chunk.seq
        s = self._active.get(rid) or self._closed.get(rid)
        if s is None:
            if seq != 0:
                raise NotFound(f"request_id {rid!r}: no session (never opened, expired or moved)")
            s = self._open(rid, self._new_state(), now)
        if s.status == SessionStatus.FAILED:
            raise Aborted(f"request_id {rid!r}: session failed earlier: {s.error.message}")
        if seq < s.next_seq:
            return self._duplicate(s, chunk)
        if s.status == SessionStatus.FINALIZED:
            raise Aborted(f"seq {seq}: session {rid!r} was finalized at seq {s.final_seq}")
        same = s.inflight if s.inflight is not None and s.inflight.seq == seq else None
        same = same or s.pending.get(seq)
        if same is not None:
            if same.digest != chunk.digest:
                raise Aborted(f"seq {seq}: payload differs from the chunk already sent under it")
            metrics.CHUNKS.labels("duplicate").inc()
            return same.future
        if s.final_seq is not None and seq > s.final_seq:
            raise Aborted(f"seq {seq}: comes after the final chunk, seq {s.final_seq}")
        if seq >= s.next_seq + cfg.reorder_window:
            raise ResourceExhausted(
                f"seq {seq}: {seq - s.next_seq} ahead of the next expected seq {s.next_seq}; "
                f"the reorder window is {cfg.reorder_window} chunks"
            )
        early = sum(c.nbytes for q, c in s.pending.items() if q > s.next_seq)
        if seq > s.next_seq and early + chunk.nbytes > cfg.reorder_bytes:
            raise ResourceExhausted(
                f"seq {seq}: reorder buffer full ({early} + {chunk.nbytes} bytes of early "
                f"chunks > {cfg.reorder_bytes})"
            )
        if chunk.finalize:
            later = [q for q in s.pending if q > seq]
            if later:
                raise Aborted(f"seq {seq}: finalize, but seq {max(later)} was already sent")
            s.final_seq = seq
        chunk.session = s
        chunk.future = asyncio.get_running_loop().create_future()
        chunk.future.add_done_callback(_silence)
        s.pending[seq] = chunk
        s.pending_bytes += chunk.nbytes
        s.last_active = now
        self._refresh(s, now)
        return chunk.future

    def attach(self, request_id: str) -> None:
        """A transport stream has sent chunks for `request_id` and is still open."""
        self._streams[request_id] = self._streams.get(request_id, 0) + 1

    def detach(self, request_id: str) -> None:
        """That stream ended (or broke): the idle timeout starts now."""
        left = self._streams.get(request_id, 0) - 1
        if left > 0:
            self._streams[request_id] = left
            return
        self._streams.pop(request_id, None)
        s = self._active.get(request_id)
        if s is not None:
            s.last_active = max(s.last_active, self.clock())

    def _duplicate(self, s: Session, chunk: MelChunk) -> asyncio.Future:
        entry = s.applied.get(chunk.seq)
        if entry is None:
            raise Aborted(
                f"seq {chunk.seq}: already applied, and older than the last "
                f"{self.config.retry_window} chunks kept for retries"
            )
        if entry.digest != chunk.digest:
            raise Aborted(f"seq {chunk.seq}: payload differs from the chunk applied under it")
        if entry.audio is None:
            raise Aborted(f"seq {chunk.seq}: audio no longer cached for retries (byte cap)")
        metrics.CHUNKS.labels("duplicate").inc()
        s.last_active = self.clock()
        if s.request_id in self._closed:
            self._closed.move_to_end(s.request_id)  # tombstones expire oldest-activity first
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(entry.audio)
        return fut

    def _open(self, rid: str, state: Any, now: float, next_seq: int = 0) -> Session:
        if len(self._active) >= self.config.max_num_sessions:
            raise ResourceExhausted(
                f"session cap reached ({self.config.max_num_sessions} open sessions)"
            )
        self._closed.pop(rid, None)
        s = Session(rid, state, now, next_seq)
        self._active[rid] = s
        metrics.ACTIVE_SESSIONS.inc()
        return s

    def _refresh(self, s: Session, now: float) -> None:
        """Recompute whether `s` has a runnable chunk and whether it is stuck on a gap."""
        runnable = (
            s.status == SessionStatus.ACTIVE
            and not s.frozen
            and s.inflight is None
            and s.next_seq in s.pending
        )
        if runnable and s.request_id not in self._ready:
            s.pending[s.next_seq].ready_at = now
            self._ready[s.request_id] = s
            self._ready_event.set()
        elif not runnable:
            self._ready.pop(s.request_id, None)
        blocked = s.inflight is None and bool(s.pending) and s.next_seq not in s.pending
        s.blocked_since = (s.blocked_since or now) if blocked else None

    # -- the batcher's side --------------------------------------------------------------------

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    def oldest_ready_at(self) -> float | None:
        for s in self._ready.values():
            return s.pending[s.next_seq].ready_at
        return None

    async def wait_ready(self) -> None:
        while not self._ready:
            self._ready_event.clear()
            await self._ready_event.wait()

    def take_ready(
        self, max_num: int, *, urgent_slack_s: float = 0.0, urgent_max_frames: int = 0
    ) -> list[MelChunk]:
        """Up to `max_num` runnable chunks, at most one per session, least slack (earliest
        playback deadline) first, then oldest first (chunks without a deadline come last, in
        arrival order, as before deadlines); each one's session is marked in flight until
        `complete` or `reject`.

        With `urgent_slack_s` > 0, a chunk whose slack (due - now) is below it is urgent: while
        any is, only urgent chunks are taken (an urgent batch), and with `urgent_max_frames` > 0
        only while the batch's padded frames (chunks x longest chunk) stay within it (the first
        always goes); the others wait for the next call, by when they may be urgent too."""
        taken: list[MelChunk] = []
        now = self.clock()
        ready = list(self._ready.values())
        picks, urgent = batch_order([s.pending[s.next_seq].due for s in ready], now, urgent_slack_s)
        longest = 0
        for s in (ready[i] for i in picks):
            if len(taken) >= max_num:
                break
            frames = s.pending[s.next_seq].num_frames
            if not fits(len(taken), longest, frames, urgent, urgent_max_frames):
                break
            del self._ready[s.request_id]
            chunk = s.pending.pop(s.next_seq)
            s.pending_bytes -= chunk.nbytes
            if s.num_frames + chunk.num_frames > self.max_session_frames:
                # Checked here, where the frames before it are known; the seq stays open so
                # a corrected chunk can be sent under it.
                self._reject(
                    s,
                    chunk,
                    InvalidArgument(
                        "mel",
                        f"{chunk.num_frames} frames after {s.num_frames} exceed the session limit "
                        f"of {self.max_session_frames} frames",
                    ),
                    now,
                )
                continue
            s.inflight = chunk
            s.idle.clear()
            s.blocked_since = None
            taken.append(chunk)
            longest = max(longest, frames)
        if urgent and taken:
            metrics.URGENT_BATCHES.inc()
        return taken

    def complete(
        self,
        chunk: MelChunk,
        audio: np.ndarray,
        *,
        compute_ms: float,
        batch_size: int,
        started_at: float,
        state_samples: int | None = None,
    ) -> None:
        """Record the applied chunk and answer it (and every duplicate waiting on it)."""
        s, now = chunk.session, self.clock()
        s.inflight = None
        s.idle.set()
        if s.status != SessionStatus.ACTIVE:
            return  # cancelled, replaced or moved while running: its waiters were answered
        n = int(audio.shape[0])
        if state_samples is not None and state_samples != s.num_samples + n:
            # Invariant 4 would break silently: stop this session loudly instead.
            s.inflight = chunk  # so that _close answers it with the error too
            self._close(
                s,
                SessionStatus.FAILED,
                "error",
                RuntimeError(
                    f"model state says {state_samples} samples emitted, service counted "
                    f"{s.num_samples} + {n}"
                ),
            )
            return
        result = AudioChunk(
            s.request_id,
            chunk.seq,
            s.num_samples,
            audio,
            chunk.finalize,
            queue_ms=max(0.0, (started_at - chunk.ready_at) * 1e3),
            compute_ms=compute_ms,
            batch_size=batch_size,
        )
        s.num_samples += n
        s.num_frames += chunk.num_frames
        s.next_seq = chunk.seq + 1
        s.last_active = now
        s.remember(chunk.seq, chunk.digest, result, self.config)
        metrics.CHUNKS.labels("applied").inc()
        metrics.CHUNK_LATENCY.observe(now - chunk.arrival)
        metrics.QUEUE_SECONDS.observe(result.queue_ms / 1e3)
        if not chunk.future.done():
            chunk.future.set_result(result)
        if chunk.finalize:
            self._close(
                s,
                SessionStatus.FINALIZED,
                "finalize",
                Aborted(f"request_id {s.request_id!r}: finalized at seq {chunk.seq}"),
            )
        else:
            self._refresh(s, now)

    def reject(self, chunk: MelChunk, exc: BaseException, *, fatal: bool) -> None:
        """The batch could not apply `chunk`. A bad input (fatal=False) leaves the state as it was
        and the seq open; anything else (fatal=True) may have left the state half-advanced, so
        the session fails."""
        s, now = chunk.session, self.clock()
        s.inflight = None
        s.idle.set()
        if s.status != SessionStatus.ACTIVE:
            return
        if fatal:
            if not chunk.future.done():
                chunk.future.set_exception(exc)
            self._close(s, SessionStatus.FAILED, "error", exc)
        else:
            self._reject(s, chunk, exc, now)

    def _reject(self, s: Session, chunk: MelChunk, exc: BaseException, now: float) -> None:
        if s.final_seq == chunk.seq:
            s.final_seq = None
        metrics.CHUNKS.labels("rejected").inc()
        if not chunk.future.done():
            chunk.future.set_exception(exc)
        self._refresh(s, now)

    # -- ending sessions -----------------------------------------------------------------------

    def _close(self, s: Session, status: SessionStatus, reason: str, exc: BaseException) -> None:
        """Take `s` out of the active set; every chunk still waiting in it gets `exc`."""
        if self._active.get(s.request_id) is s:
            del self._active[s.request_id]
            metrics.ACTIVE_SESSIONS.dec()
        self._ready.pop(s.request_id, None)
        s.status = status
        s.state = None
        waiting = list(s.pending.values()) + ([s.inflight] if s.inflight is not None else [])
        for chunk in waiting:
            if not chunk.future.done():
                chunk.future.set_exception(exc)
        if waiting:
            metrics.CHUNKS.labels("failed").inc(len(waiting))
        s.pending.clear()
        s.pending_bytes = 0
        metrics.EVICTIONS.labels(reason).inc()
        if status == SessionStatus.FAILED:
            s.error = exc if isinstance(exc, ServiceError) else Aborted("internal error")
            s.applied.clear()
            s.applied_bytes = 0
            logger.warning("session %s failed: %s", s.request_id, exc)
        if status in (SessionStatus.FINALIZED, SessionStatus.FAILED) and self.config.max_num_closed:
            self._closed[s.request_id] = s
            self._closed.move_to_end(s.request_id)
            while len(self._closed) > self.config.max_num_closed:
                self._closed.popitem(last=False)

    def cancel(self, request_id: str) -> bool:
        """Drop a session now. True if a live session was dropped, False for a tombstone."""
        s = self._active.get(request_id)
        if s is not None:
            self._close(
                s,
                SessionStatus.CANCELLED,
                "cancel",
                Aborted(f"request_id {request_id!r}: session cancelled"),
            )
            return True
        if self._closed.pop(request_id, None) is not None:
            return False
        raise NotFound(f"request_id {request_id!r}: no session")

    def sweep(self, now: float | None = None) -> None:
        """Fail sessions stuck on a gap, evict idle ones, expire tombstones, update gauges."""
        cfg = self.config
        now = self.clock() if now is None else now
        for s in list(self._active.values()):
            if s.inflight is not None or s.frozen:
                continue
            if s.blocked_since is not None and now - s.blocked_since > cfg.gap_timeout_s:
                self._close(
                    s,
                    SessionStatus.FAILED,
                    "error",
                    Aborted(
                        f"seq {s.next_seq} did not arrive within {cfg.gap_timeout_s:g} s while seq "
                        f"{min(s.pending)} waited; session {s.request_id!r} failed"
                    ),
                )
            elif (
                not s.pending
                and s.request_id not in self._streams
                and now - s.last_active > cfg.idle_timeout_s
            ):
                self._close(
                    s,
                    SessionStatus.EVICTED,
                    "idle",
                    Aborted(
                        f"request_id {s.request_id!r}: evicted after {cfg.idle_timeout_s:g} s idle"
                    ),
                )
        while self._closed:
            rid, s = next(iter(self._closed.items()))
            if now - s.last_active <= cfg.idle_timeout_s:
                break
            del self._closed[rid]
        stats = self.stats()
        metrics.CLOSED_SESSIONS.set(stats["num_closed"])
        metrics.STATE_BYTES.set(stats["state_bytes"])
        metrics.MAX_SESSION_BYTES.set(stats["max_session_bytes"])

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self.sweep()

    def stats(self) -> dict[str, int]:
        sizes = [s.nbytes for s in self._active.values()]
        closed = sum(s.nbytes for s in self._closed.values())
        return {
            "num_active": len(self._active),
            "num_closed": len(self._closed),
            "num_ready": len(self._ready),
            "state_bytes": sum(sizes) + closed,
            "max_session_bytes": max(sizes, default=0),
        }

    def session_bytes(self, request_id: str) -> int:
        s = self._active.get(request_id) or self._closed.get(request_id)
        if s is None:
            raise NotFound(f"request_id {request_id!r}: no session")
        return s.nbytes

    # -- moving sessions between replicas ------------------------------------------------------

    async def export(self, request_id: str, remove: bool) -> SessionSnapshot:
        """Snapshot a session once its running chunk (if any) has finished; early chunks still
        waiting are not part of it (with remove=True they are answered UNAVAILABLE-moved)."""
        s = self._active.get(request_id)
        if s is None:
            closed = self._closed.get(request_id)
            why = f"session is {closed.status.name.lower()}" if closed else "no session"
            raise NotFound(f"request_id {request_id!r}: {why}; nothing to export")
        if s.frozen:
            raise Aborted(f"request_id {request_id!r}: an export is already in progress")
        s.frozen = True
        self._ready.pop(request_id, None)
        try:
            await s.idle.wait()
        finally:
            s.frozen = False
            if s.status == SessionStatus.ACTIVE:
                self._refresh(s, self.clock())
        if s.status != SessionStatus.ACTIVE:
            raise NotFound(f"request_id {request_id!r}: session ended during the export")
        snap = snapshot(s, self.model_tag)
        if remove:
            self._close(
                s,
                SessionStatus.MOVED,
                "moved",
                Unavailable(f"request_id {request_id!r}: session moved to another replica"),
            )
        return snap

    def import_session(self, request_id: str, snap: SessionSnapshot, next_seq: int) -> None:
        """Open (or replace) `request_id` from an unpacked export."""
        check_request_id(request_id)
        if next_seq != snap.next_seq:
            raise InvalidArgument(
                "next_seq", f"{next_seq}, but the exported state continues at {snap.next_seq}"
            )
        try:
            state = self._load_state(snap.state)
        except ValueError as exc:
            raise InvalidArgument("state", f"HiFT state does not load: {exc}") from None
        check_state(state, snap)
        old = self._active.get(request_id)
        if old is not None:
            self._close(
                old,
                SessionStatus.REPLACED,
                "replaced",
                Aborted(f"request_id {request_id!r}: replaced by ImportSession"),
            )
        restore(self._open(request_id, state, self.clock(), snap.next_seq), snap, self.config)
