"""The flow engine's decisions, apart from threads, tensors and the real clock.

`EngineCore` holds the queue (`Scheduler`) and the batch cost model, and answers the questions
the engine's loop asks, each at `clock()`: which batch runs now or when to ask again (`step`),
whether a running batch gives way between two solver steps (`should_yield`), which urgent
batch runs then (`take_urgent`), and what a finished batch changes (`finish`: playback slips,
the cost model, the runner's view of the queue). It never waits and never runs a batch.

Two drivers run it: flow_service/engine.py with the monotonic clock, asyncio and the GPU
runner, and bench/simulate.py with a simulated clock and fitted batch costs. So the simulator
runs the engine's rules themselves; tests/test_engine_core.py drives both with one sequence of
calls and checks that they run the same batches at the same times.

Threads (engine): everything here runs on the loop thread except `should_yield`, which the
runner thread calls between two steps. It reads only `view` (a frozen value, replaced after
every change to the queue) and its own `Running`; a stale view costs one needless round trip to
the loop or one step of delay, nothing more.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flow_service.costmodel import CostModel
from flow_service.scheduler import BatchPolicy, PendingCall, Plan, QueueView, Scheduler


@dataclass
class Running:
    """A batch that may give way between its solver steps: one step's estimated seconds, the
    estimated seconds left of it, and its rows' earliest due (an urgent batch must be due
    before it: earliest deadline first)."""

    step_s: float
    remaining_s: float
    due: float


@dataclass
class Step:
    """`EngineCore.step`'s answer: calls that expired waiting (to fail), then either the batch
    to run now or, with `plan` None, when to ask again (math.inf: when a call arrives)."""

    expired: list[PendingCall] = field(default_factory=list)
    plan: Plan | None = None
    wake_at: float = math.inf


class EngineCore:
    def __init__(
        self,
        policy: BatchPolicy,
        cost: CostModel,
        preempt: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.policy = policy
        self.cost = cost
        self.preempt = preempt
        self.clock = clock
        self.scheduler = Scheduler(policy, cost)
        self.view = QueueView()
        self.num_batches = 0
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.scheduler)

    def add(self, call: PendingCall) -> None:
        """Queue a call (ResourceExhausted when the queue is full: at once, queue unchanged)."""
        self.scheduler.add(call)
        self._refresh()

    def expire(self) -> list[PendingCall]:
        """Cancelled calls leave the queue; those past their deadline are returned, to fail."""
        expired = self.scheduler.drop_finished(self.clock())
        self._refresh()
        return expired

    def step(self) -> Step:
        """The runner is free: expire what waited too long, then the batch to run now, or
        when to ask again (a batch fills, or a waiting call's deadline passes)."""
        now = self.clock()
        expired = self.scheduler.drop_finished(now)
        start_at = self.scheduler.ready_at(now)
        if start_at > now:
            self._refresh()
            deadline = min((c.deadline for c in self.scheduler.waiting), default=math.inf)
            return Step(expired, None, min(start_at, deadline))
        plan = self.scheduler.schedule(now=self.clock())
        self._refresh()
        return Step(expired, plan, now)

    def begin(self, plan: Plan, nested: bool = False) -> Running | None:
        """A batch about to run: its `Running` if it may give way between its steps, else None.
        A batch holding a first chunk without a deadline never does, nor does an urgent batch:
        nesting is one level deep."""
        if not self.preempt or nested:
            return None
        if any(c.is_first_chunk and c.due == math.inf for c in plan.calls):
            return None
        rows, length = len(plan.calls), plan.padded_len
        return Running(
            self.cost.step_s(rows, length),
            self.cost.estimate(rows, length),
            min(c.due for c in plan.calls),
        )

    def should_yield(self, running: Running) -> bool:
        """After one more solver step of `running`: must an urgent batch run now?"""
        running.remaining_s = max(0.0, running.remaining_s - running.step_s)
        return self.scheduler.preempt_due(
            self.clock(), running.step_s, running.remaining_s, running.due, self.view
        )

    def take_urgent(self, running: Running) -> Step:
        """`running` gives way: expire what waited too long, then the urgent batch (work that
        cannot wait for the rest of `running` and is due before it), if any."""
        expired = self.scheduler.drop_finished(self.clock())
        plan = self.scheduler.schedule(
            now=self.clock(),
            urgent_slack_s=self.scheduler.urgent_slack(running.step_s, running.remaining_s),
            due_before=running.due,
        )
        self._refresh()
        if plan is not None:
            plan.urgent = True
            self.num_preemptions += 1
        return Step(expired, plan)

    def finish(self, plan: Plan, own_s: float | None) -> float:
        """`plan` is done now (returned): its rows' lateness moves their streams' later
        deadlines, and `own_s` (its compute alone; None: it failed) teaches the cost model."""
        done = self.clock()
        self.scheduler.mark_busy_until(done)
        self.scheduler.finished(plan.calls, done)
        self.num_batches += 1
        if own_s is not None:
            self.cost.observe(len(plan.calls), plan.padded_len, own_s)
        self._refresh()
        return done

    def clear(self) -> list[PendingCall]:
        """Empty the queue (shutdown, a lost device): the calls that waited, to fail."""
        waiting, self.scheduler.waiting = self.scheduler.waiting, []
        self._refresh()
        return waiting

    def _refresh(self) -> None:
        self.view = self.scheduler.view()
