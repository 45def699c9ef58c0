"""Which waiting flow calls run together: the batching policy. Touches no tensors.

Calls from all streams wait in one queue. When the runner is free, `Scheduler.schedule()` makes
a `Plan`: the highest-priority call is the anchor, then further calls join in priority order
while the batch stays within `max_batch_size` rows, `max_batch_frames` padded frames
(rows x longest sequence) and `min_padding_efficiency` (real frames / padded frames). Priority:
the first chunk of a new stream before later chunks of old streams (time to first audio), then
the earliest deadline, then arrival order. Because the anchor is always the top call, a call
that does not fit a batch only waits for the batches in front of it; nothing starves.

Waiting: when the card has been idle a batch starts at once; while it is busy, a free runner
waits up to `max_wait_ms` after the oldest call's arrival for the batch to fill.

First chunks apart (`first_chunks_apart`): a batch anchored by a first chunk takes only first
chunks, and the engine lets a first chunk that arrives while a batch of later chunks runs go
between two of its solver steps (`schedule(first_chunks_only=True)` forms that batch). Time to
first audio is then one solver step of waiting plus a short batch, not two long batches.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from token2wav.errors import ResourceExhausted


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = 64  # requests per batch (2x rows in the solver: CFG); 1 = batching off
    max_batch_frames: int = 64 * 800  # rows x padded length, bounds activation memory
    max_wait_ms: float = 5.0  # how long a busy service lets a batch fill
    max_queue: int = 1024  # waiting calls; past it new calls get RESOURCE_EXHAUSTED
    # Real frames / padded frames a batch must keep when a call joins; below it the call waits
    # for a batch nearer its own length instead of riding along (padding is wasted compute).
    min_padding_efficiency: float = 0.7
    # A batch led by a first chunk takes only first chunks: it stays short (one 200-frame
    # chunk per stream), so time to first audio is not the compute time of a batch of long
    # later chunks. Pairs with the engine's preemption (both on with --preempt).
    first_chunks_apart: bool = True

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")


class CallStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    DONE = 2
    CANCELLED = 3
    EXPIRED = 4


@dataclass(eq=False)
class PendingCall:
    """One Generate call in the scheduler's hands."""

    num_seq_frames: int  # DiT sequence length T: the cost and padding unit
    num_out_frames: int
    is_first_chunk: bool  # token_offset == 0
    deadline: float  # monotonic seconds; math.inf when the caller set none
    payload: Any  # what the runner needs (a ChunkRequest); opaque here
    arrival: float = field(default_factory=time.monotonic)
    call_id: int = field(default_factory=itertools.count().__next__)
    status: CallStatus = CallStatus.WAITING

    def priority(self) -> tuple:
        return (not self.is_first_chunk, self.deadline, self.arrival, self.call_id)


@dataclass
class Plan:
    calls: list[PendingCall]  # [num_reqs] slot i of the batch is calls[i]
    padded_len: int  # longest T in the batch
    urgent: bool = False  # first chunks run between the steps of a running batch

    @property
    def num_padded_frames(self) -> int:
        return len(self.calls) * self.padded_len

    @property
    def num_real_frames(self) -> int:
        return sum(c.num_seq_frames for c in self.calls)

    @property
    def padding_efficiency(self) -> float:
        return self.num_real_frames / max(1, self.num_padded_frames)


class Scheduler:
    def __init__(self, policy: BatchPolicy):
        self.policy = policy
        self.waiting: list[PendingCall] = []
        self.last_busy = -math.inf  # monotonic time the runner last finished a batch

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, call: PendingCall) -> None:
        if len(self.waiting) >= self.policy.max_queue:
            raise ResourceExhausted(
                f"flow queue full ({self.policy.max_queue} calls waiting); retry later"
            )
        self.waiting.append(call)

    def drop_finished(self, now: float) -> list[PendingCall]:
        """Remove cancelled calls and expire those past their deadline; returns the expired."""
        expired = []
        keep = []
        for call in self.waiting:
            if call.status == CallStatus.WAITING and call.deadline <= now:
                call.status = CallStatus.EXPIRED
                expired.append(call)
            elif call.status == CallStatus.WAITING:
                keep.append(call)
        self.waiting = keep
        return expired

    def ready_at(self, now: float) -> float:
        """When a batch should start: now if the card was idle or the batch is full, else at
        the oldest call's arrival + max_wait."""
        if not self.waiting:
            return math.inf
        wait = self.policy.max_wait_ms / 1000.0
        idle = now - self.last_busy > wait
        if idle or len(self.waiting) >= self.policy.max_batch_size:
            return now
        return min(c.arrival for c in self.waiting) + wait

    @property
    def num_first_chunks_waiting(self) -> int:
        return sum(c.is_first_chunk and c.status == CallStatus.WAITING for c in self.waiting)

    def schedule(self, first_chunks_only: bool = False) -> Plan | None:
        """Take the next batch out of the queue (only first chunks, if asked)."""
        order = sorted(
            (c for c in self.waiting if c.is_first_chunk or not first_chunks_only),
            key=PendingCall.priority,
        )
        if not order:
            return None
        if order[0].is_first_chunk and self.policy.first_chunks_apart:
            order = [c for c in order if c.is_first_chunk]
        anchor = order[0]
        chosen = [anchor]
        padded = anchor.num_seq_frames
        real = anchor.num_seq_frames
        p = self.policy
        for call in order[1:]:
            if len(chosen) >= p.max_batch_size:
                break
            new_padded = max(padded, call.num_seq_frames)
            rows = len(chosen) + 1
            if rows * new_padded > p.max_batch_frames:
                continue
            if (real + call.num_seq_frames) / (rows * new_padded) < p.min_padding_efficiency:
                continue
            chosen.append(call)
            padded, real = new_padded, real + call.num_seq_frames
        taken = set(map(id, chosen))
        self.waiting = [c for c in self.waiting if id(c) not in taken]
        for call in chosen:
            call.status = CallStatus.RUNNING
        return Plan(chosen, padded)

    def mark_busy_until(self, t: float) -> None:
        self.last_busy = t
