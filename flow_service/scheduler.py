"""Which waiting flow calls run together: the batching policy. Touches no tensors.

Calls from all streams wait in one queue. When the runner is free, `Scheduler.schedule()` makes
a `Plan`: the highest-priority call is the anchor, then further calls join in priority order
while the batch stays within `max_batch_size` rows, `max_batch_frames` padded frames
(rows x longest sequence) and `min_padding_efficiency` (real frames / padded frames, of the
sequences and of the frames computed, `num_query_frames`: what is not read from the prefix
cache). Priority:
the first chunk of a new stream before later chunks of old streams (time to first audio), then
the earliest deadline, then arrival order. Because the anchor is always the top call, a call
that does not fit a batch only waits for the batches in front of it; nothing starves.

Waiting: when the card has been idle a batch starts at once; while it is busy, a free runner
waits up to `max_wait_ms` after the oldest call's arrival for the batch to fill.

First chunks apart (`first_chunks_apart`): a batch anchored by a first chunk takes only first
chunks, and the engine lets a first chunk that arrives while a batch of later chunks runs go
between two of its solver steps (`schedule(first_chunks_only=True)` forms that batch). Time to
first audio is then one solver step of waiting plus a short batch, not two long batches.

Deadlines (with a `CostModel`): a call may carry a playback deadline
(`due`, from the gateway's slack). When any waiting call has one, the queue is ordered by slack
instead: due - now - the estimated time of a batch of that call alone, least first; calls
without one come after, in today's order. The anchor is the least-slack call; others join by
slack under the same size, frame and padding limits, and a join is refused when the bigger
batch would make a row late that is on time without it: a row in the batch, or a row left
out (for padding) that could still start after this batch and make its deadline. Preemption
generalises: work whose slack is below one solver step of the running batch
(`schedule(urgent_slack_s=step)`) runs between its steps. A queue in which no call has a
deadline (clients that send no slack_ms) is ordered and preempted first chunks first, as above.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from flow_service.costmodel import CostModel
from token2wav.errors import ResourceExhausted


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = 64  # requests per batch (2x rows in the solver: CFG); 1 = batching off
    max_batch_frames: int = 64 * 800  # rows x padded length, bounds activation memory
    max_wait_ms: float = 5.0  # how long a busy service lets a batch fill
    max_queue: int = 1024  # waiting calls; past it new calls get RESOURCE_EXHAUSTED
    # Real frames / padded frames a batch must keep when a call joins; below it the call waits
    # for a batch nearer its own length instead of riding along (padding is wasted compute).
    # 0.8, not 0.7: on an H100 the mixed workload went from 82 / 78-86 % to 90 / 93-94 % on
    # time at 9 / 12 streams/s, in two paired runs (docs/bench/2026-12-07-h100-night.md).
    min_padding_efficiency: float = 0.8
    # A batch led by a first chunk takes only first chunks: it stays short (one 200-frame
    # chunk per stream), so time to first audio is not the compute time of a batch of long
    # later chunks. Pairs with the engine's preemption.
    first_chunks_apart: bool = True
    # Rows of a batch led by a late call, or formed from a queue that is tight even at full
    # throughput (see Scheduler.schedule): large enough to keep most of the card's throughput
    # (per row, larger batches are faster up to about this size), small enough that late work comes out in a pipeline of batches, not in one long one.
    late_batch_rows: int = 32

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.late_batch_rows < 1:
            raise ValueError("late_batch_rows must be >= 1")


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
    payload: Any  # what the runner needs (a FlowRequest); opaque here
    arrival: float = field(default_factory=time.monotonic)
    call_id: int = field(default_factory=itertools.count().__next__)
    status: CallStatus = CallStatus.WAITING
    # Playback deadline (monotonic s; math.inf: none). Soft: a late call still runs, unlike
    # `deadline` (the RPC's), past which it fails.
    due: float = math.inf
    # The stream it belongs to ("" : unknown) and its place in it: when a stream's call
    # finishes late, the player waits for it, so the stream's later calls are needed that
    # much later too (`Scheduler.finished`).
    stream: str = ""
    token_offset: int = 0
    final: bool = False
    # Of the sequence, the frames it should read from the prefix cache rather than compute
    # (prefix_cache.readable_prefix; 0: all computed). Padding counts computed frames too.
    num_cached_frames: int = 0
    sent: float = -math.inf  # when the caller fixed `due` (it reached the service): lateness
    # of the stream's calls that finished after this moment is not in `due` yet

    @property
    def num_query_frames(self) -> int:
        return self.num_seq_frames - self.num_cached_frames

    def priority(self) -> tuple:
        return (not self.is_first_chunk, self.deadline, self.arrival, self.call_id)


@dataclass(frozen=True)
class QueueView:
    """The queue as `Scheduler.preempt_due` reads it: first chunks without a deadline
    waiting (which preempt while no call has a deadline), the earliest latest start and the
    earliest due of the waiting calls (math.inf: none)."""

    first_chunks_waiting: int = 0
    latest_start: float = math.inf
    min_due: float = math.inf


@dataclass
class Plan:
    calls: list[PendingCall]  # [num_reqs] slot i of the batch is calls[i]
    padded_len: int  # longest T in the batch
    urgent: bool = False  # first chunks run between the steps of a running batch
    path: str = ""  # how the runner ran it (FlowRunner.last_path), for --log-batches
    # Waiting calls this batch was formed without, by what kept each out (`LEFT_OUT`): what
    # limits batch size when calls wait but batches stay small.
    left_out: dict[str, int] = field(default_factory=dict)

    @property
    def num_padded_frames(self) -> int:
        return len(self.calls) * self.padded_len

    @property
    def num_real_frames(self) -> int:
        return sum(c.num_seq_frames for c in self.calls)

    @property
    def padding_efficiency(self) -> float:
        return self.num_real_frames / max(1, self.num_padded_frames)


# Why a waiting call stayed out of the batch formed from its pool (Plan.left_out): `rows` the
# batch's row limit (max_batch_size, or late_batch_rows for late work), `frames`
# max_batch_frames, `padding` min_padding_efficiency (of the sequences or of the frames
# computed), `deadline` the on-time limit (it would make an on-time row late), `first_chunks`
# a first-chunks-only batch.
LEFT_OUT = ("rows", "frames", "padding", "deadline", "first_chunks")


class Scheduler:
    MAX_STREAMS_TRACKED = 4096  # streams whose lateness is carried (oldest forgotten first)

    def __init__(self, policy: BatchPolicy, cost: CostModel | None = None):
        self.policy = policy
        self.cost = cost  # None: deadlines are ignored (today's order)
        self.waiting: list[PendingCall] = []
        # stream -> [(when, seconds)] its calls that finished late (the player waited)
        self._slip: dict[str, list[tuple[float, float]]] = {}
        self.last_busy = -math.inf  # monotonic time the runner last finished a batch

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, call: PendingCall) -> None:
        if len(self.waiting) >= self.policy.max_queue:
            raise ResourceExhausted(
                f"flow queue full ({self.policy.max_queue} calls waiting); retry later"
            )
        if call.stream and call.due < math.inf:
            call.due += sum(late for t, late in self._slip.get(call.stream, ()) if t > call.sent)
        self.waiting.append(call)

    def finished(self, calls: list[PendingCall], now: float) -> None:
        """Calls whose results are out at `now`. A call that finished after its `due` delays
        its stream's playback by as much (the player waits for it, or starts later), so the
        stream's calls after it are needed that much later: waiting ones move now, later ones
        when they are added, if they were sent before (a deadline computed later already
        counts from the audio actually sent). Without this a late first chunk leaves its stream's later calls
        with deadlines the player no longer has, and they crowd out streams that are on time."""
        for call in calls:
            if not call.stream or call.due == math.inf:
                continue
            if call.final:
                self._slip.pop(call.stream, None)
                continue
            late = now - call.due
            if late <= 0:
                continue
            events = self._slip.pop(call.stream, [])
            self._slip[call.stream] = [*events[-7:], (now, late)]
            while len(self._slip) > self.MAX_STREAMS_TRACKED:
                del self._slip[next(iter(self._slip))]
            for c in self.waiting:
                if c.stream == call.stream and c.token_offset > call.token_offset:
                    c.due += late

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
        if len(self.waiting) >= self.policy.max_batch_size:
            return now
        idle = now - self.last_busy > wait
        if idle:
            return now
        # A call that cannot afford the wait for the batch to fill starts it now.
        return min(min(c.arrival for c in self.waiting) + wait, self.latest_start())

    def _by_slack(self) -> bool:
        """Whether the queue is in slack order (some waiting call has a playback deadline) or
        in the first-chunks-first order: the one for calls without a deadline (clients that
        send no slack_ms straight to the flow service), which preempt as first chunks."""
        return self.cost is not None and any(c.due < math.inf for c in self.waiting)

    def latest_start(self) -> float:
        """The earliest of the waiting calls' latest start times (due minus the time of a
        batch of that call alone); math.inf when none has a deadline."""
        if not self._by_slack():
            return math.inf
        est = self.cost.estimate
        return min(c.due - est(1, c.num_seq_frames) for c in self.waiting if c.due < math.inf)

    def slack(self, call: PendingCall, now: float) -> float:
        """Seconds to spare if `call` started alone now (math.inf without a deadline)."""
        if call.due == math.inf or self.cost is None:
            return math.inf
        return call.due - now - self.cost.estimate(1, call.num_seq_frames)

    def _slack_key(self, now: float):
        def key(c: PendingCall) -> tuple:
            if c.due < math.inf:
                return (0, self.slack(c, now), c.arrival, c.call_id)
            return (1, float(not c.is_first_chunk), c.arrival, c.call_id)

        return key

    def is_urgent(
        self, call: PendingCall, now: float, urgent_slack_s: float, before: float = math.inf
    ) -> bool:
        """Work that may run between the solver steps of a running batch: a call whose slack
        is below one step; with no deadline in the queue, a first chunk. Calls
        without a deadline never preempt work that has one."""
        if not self._by_slack():
            return call.is_first_chunk
        return call.due < min(math.inf, before) and self.slack(call, now) < urgent_slack_s

    def min_due(self) -> float:
        """The earliest playback deadline among the waiting calls (math.inf: none)."""
        if not self._by_slack():
            return math.inf
        return min(c.due for c in self.waiting)

    def view(self) -> QueueView:
        """What `preempt_due` reads of the queue, as one value another thread may hold."""
        return QueueView(self.num_first_chunks_waiting, self.latest_start(), self.min_due())

    def preempt_due(
        self,
        now: float,
        step_s: float,
        remaining_s: float,
        running_due: float = math.inf,
        view: QueueView | None = None,
    ) -> bool:
        """Between two solver steps of a running batch (one step `step_s`, `remaining_s` of it
        left, its earliest row due at `running_due`): whether to ask for an urgent batch now.
        Yes when a first chunk without a deadline waits, or when a waiting call could not wait
        for the rest of the batch and still make its deadline and it is due before the
        running rows (earliest deadline first: a batch is only overtaken by work more urgent
        than its own). `view`: the queue as `view()` saw it (the engine's runner thread asks
        while the loop thread changes the queue); None: the queue now."""
        q = self.view() if view is None else view
        if q.first_chunks_waiting:
            return True
        wait = max(step_s, remaining_s)
        return now + wait >= q.latest_start and q.min_due < running_due

    def urgent_slack(self, step_s: float, remaining_s: float) -> float:
        """The slack below which waiting work goes between the steps of the running batch:
        what cannot wait for the rest of it."""
        return max(step_s, remaining_s)

    @property
    def num_first_chunks_waiting(self) -> int:
        """First chunks that preempt by being first chunks: 0 while any call has a deadline
        (then work preempts by slack)."""
        if self._by_slack():
            return 0
        return sum(
            c.is_first_chunk and c.due == math.inf and c.status == CallStatus.WAITING
            for c in self.waiting
        )

    def schedule(
        self,
        first_chunks_only: bool = False,
        now: float | None = None,
        urgent_slack_s: float | None = None,
        due_before: float = math.inf,
    ) -> Plan | None:
        """Take the next batch out of the queue: only first chunks, if asked; only urgent
        work (`is_urgent` with `urgent_slack_s`, due before `due_before`), if that is given."""
        now = time.monotonic() if now is None else now
        by_slack = self._by_slack()
        if urgent_slack_s is not None:
            pool = [c for c in self.waiting if self.is_urgent(c, now, urgent_slack_s, due_before)]
        else:
            pool = [c for c in self.waiting if c.is_first_chunk or not first_chunks_only]
        order = sorted(pool, key=self._slack_key(now) if by_slack else PendingCall.priority)
        if not order:
            return None
        lead = order[0]
        left_out = dict.fromkeys(LEFT_OUT, 0)
        if lead.is_first_chunk and lead.due == math.inf and self.policy.first_chunks_apart:
            left_out["first_chunks"] = sum(not c.is_first_chunk for c in order)
            order = [c for c in order if c.is_first_chunk]
        chosen = [lead]
        padded = real = lead.num_seq_frames
        padded_q = real_q = lead.num_query_frames
        p = self.policy
        est = self.cost.estimate if by_slack else None
        free_rows = 0  # rows that may join without the on-time limit (a crowded queue)
        # The batch may not end after `limit`: the deadline of a chosen row that is on time,
        # or the latest start of a row left out that can still make its deadline afterwards.
        limit = math.inf
        max_rows = p.max_batch_size
        if est is not None and lead.due < math.inf:
            rows_e = min(p.late_batch_rows, p.max_batch_size)
            if now + est(1, padded) > lead.due:
                # The lead is late whatever runs: every second this batch takes is lateness.
                # It grows only while rows still buy throughput, so late work comes out in a
                # pipeline of batches the vocoder can start on, not in one long one.
                max_rows = rows_e
            elif self._crowded(order, now):
                # The queue is tight even at full throughput: batches cut to keep the lead on
                # time would serve it a few rows at a time, at a fraction of the card's
                # throughput, until every call is late. An efficient batch serves the least
                # slack first; past its size the on-time limit holds again.
                max_rows, free_rows = rows_e, rows_e
            else:
                limit = lead.due
        for i, call in enumerate(order[1:]):
            if len(chosen) >= max_rows:
                left_out["rows"] += len(order) - 1 - i
                break
            new_padded = max(padded, call.num_seq_frames)
            new_padded_q = max(padded_q, call.num_query_frames)
            rows = len(chosen) + 1
            # Padding in the frames computed as well as in the sequence: a batch pads every
            # row's computed frames to its longest row's (the cache's query run), so a final
            # call (all of its frames) and a later chunk of the same length reading most of
            # its frames from the cache make a batch that computes the final's frames twice.
            seq_eff = (real + call.num_seq_frames) / (rows * new_padded)
            query_eff = (real_q + call.num_query_frames) / (rows * new_padded_q)
            reason = None
            if rows * new_padded > p.max_batch_frames:
                reason = "frames"
            elif min(seq_eff, query_eff) < p.min_padding_efficiency:
                reason = "padding"
            fits = reason is None
            if est is not None and rows <= free_rows:
                pass
            elif est is not None:
                end = now + est(rows, new_padded)
                if fits and end > limit:
                    fits, reason = False, "deadline"
                if fits and end <= call.due:
                    limit = min(limit, call.due)
                if not fits and call.due < math.inf:
                    start = call.due - est(1, call.num_seq_frames)
                    if start >= now + est(len(chosen), padded):
                        limit = min(limit, start)
            if not fits:
                left_out[reason] += 1
                continue
            chosen.append(call)
            padded, real = new_padded, real + call.num_seq_frames
            padded_q, real_q = new_padded_q, real_q + call.num_query_frames
        taken = set(map(id, chosen))
        self.waiting = [c for c in self.waiting if id(c) not in taken]
        for call in chosen:
            call.status = CallStatus.RUNNING
        return Plan(chosen, padded, left_out={k: n for k, n in left_out.items() if n})

    def _crowded(self, order: list[PendingCall], now: float) -> bool:
        """Whether the queue, run in this order at the throughput of efficient batches, would
        still make a call late: then batches sized to keep each lead on time (a few rows
        each, at a fraction of the card's throughput) would make all of them late."""
        rows = min(self.policy.late_batch_rows, self.policy.max_batch_size)
        end = now
        for c in order:
            end += self.cost.estimate(rows, c.num_seq_frames) / rows
            if c.due < end:
                return True
        return False

    def mark_busy_until(self, t: float) -> None:
        self.last_busy = t
