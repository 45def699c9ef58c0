"""Admission control: a new stream is admitted only if the flow replicas can keep every admitted
stream on time with it.

Load model. Each admitted stream lists its flow work still to do as (deadline, frames) items:
the chunks in flight or waiting for tokens, and the chunks it will still need (projected with
the stream's own chunk schedule up to the tokens it has, or `expected_tokens` while its input is
open). A chunk's work is its DiT sequence length (prompt + prefix frames), the unit in which the
flow replicas report their learned capacity (GenerateResponse.capacity_frames_per_s; summed over
replicas heard from recently, times `headroom` for batching losses and the vocoder). Served
earliest deadline first at that rate, item i is late by

  now + (work of items due no later than i) / capacity - due_i

The new stream is admitted when each of its items (first chunk due now + the first-chunk
target) finishes within `tolerance` of its deadline and no admitted item is made late that was
on time, or later than it was (streams already late are not blamed on the newcomer, nor made
later by it); otherwise the call is refused with RESOURCE_EXHAUSTED at once, or after at most
`max_wait` of waiting for streams to finish. Item by item, not worst case against worst case:
once one admitted chunk is estimated late, a newcomer queued behind it would leave that
maximum unchanged however late it came itself, and be admitted. While no replica has reported a capacity yet (cold start) streams are admitted.

Feedback. The estimate is optimistic by construction: it assumes
every frame runs at the large-batch rate, while at moderate load batches are small, the
vocoder shares the GPU and the gateway's CPU adds its own delay. So the controller also watches
what it is meant to prevent: each chunk that reaches the client later than its player needed it
(beyond `tolerance_s`, input-forced waits excluded; PlaybackClock.needed_at) cuts the capacity
it plans with by `feedback_cut` (at most once per `feedback_interval_s`: one overload burst
makes many chunks late at once), down to `feedback_floor`; each chunk on time wins back
`feedback_recover` of it. Multiplicative decrease, additive increase: under sustained overload
the admitted rate settles just under what the stack keeps on time.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from gateway import metrics
from gateway.deadlines import DeadlineConfig, PlaybackClock
from gateway.schedule import ChunkPlanner, FlowCall
from token2wav.errors import ResourceExhausted


@dataclass(frozen=True)
class AdmissionConfig:
    enabled: bool = False
    headroom: float = 0.8  # share of the reported capacity the estimate may plan with
    tolerance_s: float = 0.02  # lateness that still counts as on time
    # Length assumed for a stream whose input is still open: 250 tokens, 10 s of speech.
    expected_tokens: int = 250
    max_wait_s: float = 0.0  # how long a refused stream may wait for room; 0: refuse at once
    report_ttl_s: float = 60.0  # a replica's report counts this long
    feedback_cut: float = 0.7  # capacity factor per late-chunk event
    feedback_interval_s: float = 1.0  # at most one cut per this long
    feedback_recover: float = 0.002  # factor won back per on-time chunk
    feedback_floor: float = 0.1  # the factor never goes below this

    def __post_init__(self):
        if not 0 < self.headroom <= 1:
            raise ValueError("--admission-headroom: want 0 < h <= 1")
        if self.expected_tokens < 1:
            raise ValueError("admission expected_tokens: want >= 1")
        if self.max_wait_s < 0:
            raise ValueError("--admission-wait-ms: want >= 0")
        if self.tolerance_s < 0:
            raise ValueError("admission tolerance_s: want >= 0")
        if not (0 < self.feedback_cut < 1 and 0 < self.feedback_floor <= 1):
            raise ValueError("admission feedback: want 0 < cut < 1 and 0 < floor <= 1")


class Workload(Protocol):
    def remaining_work(self, now: float, expected_tokens: int) -> list[tuple[float, int]]:
        """(deadline, frames) of the stream's flow work still to do, assuming
        `expected_tokens` in all while its input is open."""


def remaining_work(
    planner: ChunkPlanner,
    playback: PlaybackClock | None,
    num_prompt_tokens: int,
    in_flight: Iterable[tuple[FlowCall, float | None, float]],
    num_tokens: int,
    ended: bool,
    now: float,
    expected_tokens: int,
) -> list[tuple[float, int]]:
    """(deadline, DiT frames) of every flow call a stream still needs: `in_flight`, its calls
    planned and not answered, as (chunk, the due sent with it or None, when its tokens were
    in); then the chunks `planner` (left as it is) will still make, up to `num_tokens` (input
    `ended`) or `expected_tokens` (input open). Without `playback` (deadlines off) the
    deadlines are projected with the default `DeadlineConfig`."""
    clock = playback or PlaybackClock(DeadlineConfig())
    items = []
    for chunk, due, ready_at in in_flight:
        if due is None:
            due = clock.due(chunk, ready_at, project=True)
        items.append((due, chunk.num_seq_frames(num_prompt_tokens)))
    planner = copy.copy(planner)
    total = num_tokens if ended else max(expected_tokens, num_tokens + 1)
    while (chunk := planner.next_call(total, True)) is not None:
        items.append((clock.due(chunk, now, project=True), chunk.num_seq_frames(num_prompt_tokens)))
    return items


class CapacityBoard:
    """The latest capacity each flow replica reported (frames/s), by address."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._reports: dict[str, tuple[float, float]] = {}  # address -> (frames/s, when)

    def report(self, addr: str, frames_per_s: float) -> None:
        if frames_per_s > 0:
            self._reports[addr] = (frames_per_s, self.clock())

    def total(self, ttl_s: float) -> float:
        now = self.clock()
        return sum(c for c, t in self._reports.values() if now - t <= ttl_s)


def edf_lateness(items: list[tuple[float, int]], capacity: float, now: float) -> list[float]:
    """EDF at `capacity` frames/s: each item's (finish - deadline), in the items' order. Ties
    keep list order (items listed first are served first)."""
    late = [0.0] * len(items)
    done = 0.0
    for i in sorted(range(len(items)), key=lambda i: items[i][0]):
        due, frames = items[i]
        done += frames
        late[i] = now + done / capacity - due
    return late


class AdmissionController:
    def __init__(
        self,
        config: AdmissionConfig,
        board: CapacityBoard,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.board = board
        self.clock = clock
        self.streams: set[Workload] = set()
        self._changed = asyncio.Condition()
        self.factor = 1.0  # feedback on the estimate: 1 until a chunk comes late
        self._last_cut = -float("inf")

    def capacity(self) -> float:
        return self.board.total(self.config.report_ttl_s) * self.config.headroom * self.factor

    def observe(self, lateness_s: float) -> None:
        """A chunk reached its client `lateness_s` after its player needed it (< 0: early)."""
        cfg = self.config
        if not cfg.enabled:
            return
        if lateness_s > cfg.tolerance_s:
            now = self.clock()
            if now - self._last_cut >= cfg.feedback_interval_s:
                self._last_cut = now
                self.factor = max(cfg.feedback_floor, self.factor * cfg.feedback_cut)
                metrics.ADMISSION_FACTOR.set(self.factor)
        elif self.factor < 1.0:
            self.factor = min(1.0, self.factor + cfg.feedback_recover)
            metrics.ADMISSION_FACTOR.set(self.factor)

    def check(self, stream: Workload) -> tuple[bool, str]:
        """(admit?, why not) for one more stream, on the current estimate."""
        if not self.config.enabled:
            return True, ""
        capacity = self.capacity()
        metrics.FLOW_CAPACITY.set(capacity)
        if capacity <= 0:
            return True, ""  # nothing measured yet: fail open
        now = self.clock()
        n = self.config.expected_tokens
        items = [i for s in self.streams for i in s.remaining_work(now, n)]
        new = stream.remaining_work(now, n)
        worst = self.lateness_caused(items, new, capacity, now)
        if worst <= self.config.tolerance_s:
            return True, ""
        return False, (
            f"flow capacity: with {len(self.streams)} streams in flight one more would make "
            f"chunks late by {worst * 1e3:.0f} ms (planning with {capacity:.0f} frames/s); "
            "retry later"
        )

    def lateness_caused(self, items, new, capacity: float, now: float) -> float:
        """The rule (module docstring): the worst lateness admitting the `new` items among the
        admitted `items` would be to blame for, the newcomer's own or an admitted item's made
        late or later; at most `tolerance_s` admits."""
        tol = self.config.tolerance_s
        before = edf_lateness(items, capacity, now)
        after = edf_lateness(items + new, capacity, now)  # ties: admitted streams first
        worst = max(after[len(items) :], default=-float("inf"))  # the newcomer's own
        for was, now_late in zip(before, after):  # what it does to the admitted ones
            if now_late > max(tol, was) + 1e-9:
                worst = max(worst, now_late)
        return worst

    async def admit(self, stream: Workload) -> None:
        """Admit `stream` (it then counts until `release`) or raise RESOURCE_EXHAUSTED."""
        ok, why = self.check(stream)
        if not ok and self.config.max_wait_s > 0:
            give_up = self.clock() + self.config.max_wait_s
            async with self._changed:
                while not ok and (left := give_up - self.clock()) > 0:
                    try:
                        await asyncio.wait_for(self._changed.wait(), left)
                    except asyncio.TimeoutError:
                        pass
                    ok, why = self.check(stream)
        if not ok:
            metrics.ADMISSION_REFUSED.inc()
            raise ResourceExhausted(why)
        self.streams.add(stream)

    async def release(self, stream: Workload) -> None:
        """The stream ended (or made progress): a waiting admission may look again."""
        self.streams.discard(stream)
        await self.progress()

    async def progress(self) -> None:
        if self.config.max_wait_s > 0:
            async with self._changed:
                self._changed.notify_all()
