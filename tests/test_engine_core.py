"""The flow engine (flow_service/engine.py) and the simulator's engine (bench/simulate.py
`SimulatedEngine`) drive one `EngineCore`: given the same calls arriving at the same times
and batches of the same cost, they must run the same batches (the same calls, urgent or not)
at the same times. The engine runs for real (its asyncio loop, its runner thread, the
runner's between-steps plumbing) on a fake clock, with only the model's solve replaced by
fixed costs; the simulator on its event clock. No sleeps decide anything: each side's time
moves only by the costs and the arrivals."""

from __future__ import annotations

import asyncio
import math
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from test_deadlines import FakeCost

import flow_service.runner
from bench.simulate import EventClock, SimulatedEngine
from flow_service.core import EngineCore
from flow_service.costmodel import CostModel
from flow_service.engine import FlowEngine
from flow_service.model import FlowRequest, Voice
from flow_service.model.config import NUM_STEPS, PRE_LOOKAHEAD, TOKEN_MEL_RATIO
from flow_service.runner import FlowRunner
from flow_service.scheduler import BatchPolicy, PendingCall

PROMPT_TOKENS = 25
# (DiT frames, token_offset, final): a first chunk, two later chunks, a final call
KINDS = ((200, 0, False), (300, 25, False), (500, 75, False), (650, 175, True))
# waiting for a batch to fill is a real sleep in the engine: off, so that time is the fake one
POLICY = BatchPolicy(max_wait_ms=0.0, max_batch_size=16, late_batch_rows=8)


def batch_s(rows: int, longest: int) -> float:
    return 0.01 + 4e-6 * rows * longest


def arrivals(seed: int, deadlines: bool, n: int = 80) -> list[dict]:
    """`n` calls at random times over 0.4 s; with `deadlines`, most carry a playback due."""
    rng = np.random.default_rng(seed)
    times = np.sort(rng.uniform(0.0, 0.4, n))
    out = []
    for i, t in enumerate(times):
        frames, offset, final = KINDS[rng.integers(len(KINDS))]
        due = math.inf
        if deadlines and rng.uniform() < 0.85:
            due = float(t + rng.uniform(0.005, 0.25))
        out.append(
            dict(key=f"c{i}", t=float(t), frames=frames, offset=offset, final=final, due=due)
        )
    return out


def simulated(calls: list[dict]) -> list[tuple]:
    clock = EventClock()
    core = EngineCore(POLICY, CostModel(NUM_STEPS), True, lambda: clock.now)
    log = []

    def done(plan, started, now):
        log.append((started, now, tuple(c.payload for c in plan.calls), plan.urgent))

    engine = SimulatedEngine(
        core, clock, lambda plan: batch_s(len(plan.calls), plan.padded_len), 0.0, done
    )

    def arrive(a: dict) -> None:
        n_emit = a["frames"] // TOKEN_MEL_RATIO - PROMPT_TOKENS
        engine.add(
            PendingCall(
                num_seq_frames=a["frames"],
                num_out_frames=TOKEN_MEL_RATIO * (n_emit - a["offset"]),
                is_first_chunk=a["offset"] == 0,
                deadline=math.inf,
                payload=a["key"],
                arrival=clock.now,
                due=a["due"],
                stream=a["key"],
                token_offset=a["offset"],
                final=a["final"],
                sent=clock.now,
            )
        )

    for a in calls:
        clock.at(a["t"], arrive, a)
    clock.run()
    return sorted(log)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingExecutor(ThreadPoolExecutor):
    """The runner's one worker, counting the batches handed to it (on the loop thread)."""

    def __init__(self):
        super().__init__(1, thread_name_prefix="flow-runner")
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


class FixedCostRunner(FlowRunner):
    """The real runner with the model's solve replaced: a batch takes `batch_s` on the fake
    clock in NUM_STEPS equal steps (the runner's between-steps hook after each but the last),
    an urgent batch (one run inside another's step) whole, as SimulatedEngine has it. Calls
    whose time comes while the clock moves are submitted to the engine on its loop first."""

    def __init__(self, model, clock: FakeClock, pending: list[dict], submit):
        super().__init__(model, cuda_graphs=False)
        self.executor.shutdown()
        self.executor = CountingExecutor()
        self.clock = clock
        self.pending = pending  # arrivals not yet submitted, by time
        self.submit = submit  # loop thread: queue one arrival in the engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self.depth = 0
        self.log = []

    def _advance(self, t: float) -> None:
        while self.pending and self.pending[0]["t"] <= t:
            a = self.pending.pop(0)
            self.clock.now = a["t"]
            asyncio.run_coroutine_threadsafe(self.submit(a), self.loop).result(10)
        self.clock.now = t

    def _settle(self) -> None:
        """Let the loop thread handle what the runner handed it (an urgent batch's results)
        before the clock moves on, as it does at once on an idle CPU."""
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result(10)

    def generate(self, requests, ask_engine=None, use_cache=True):
        between_steps = self._hook(ask_engine, sync_every_step=False)
        self.depth += 1
        try:
            started = self.clock.now
            cost = batch_s(len(requests), max(r.num_seq_frames for r in requests))
            if self.depth > 1:
                self._advance(started + cost)
            else:
                step = cost / NUM_STEPS
                for k in range(NUM_STEPS):
                    self._advance(self.clock.now + step)
                    if between_steps is not None and k + 1 < NUM_STEPS:
                        between_steps()
                        self._settle()
            keys = tuple(r.cache_key for r in requests)
            self.log.append((started, self.clock.now, keys, self.depth > 1))
            return [torch.zeros(80, 1) for _ in requests]
        finally:
            self.depth -= 1


def request(voice: Voice, a: dict) -> FlowRequest:
    n_emit = a["frames"] // TOKEN_MEL_RATIO - PROMPT_TOKENS
    tokens = torch.zeros(n_emit + (0 if a["final"] else PRE_LOOKAHEAD), dtype=torch.long)
    return FlowRequest(voice, tokens, a["offset"], a["final"], not a["final"], cache_key=a["key"])


async def served(calls: list[dict], monkeypatch) -> list[tuple]:
    clock = FakeClock()
    # the runner times batches (own time apart from urgent ones nested in it) on that clock
    monkeypatch.setattr(flow_service.runner, "time", types.SimpleNamespace(perf_counter=clock))
    voice = Voice(
        torch.zeros(PROMPT_TOKENS, dtype=torch.long),
        torch.zeros(TOKEN_MEL_RATIO * PROMPT_TOKENS, 80),
        torch.zeros(192),
    )
    model = torch.nn.Linear(1, 1)  # the runner reads its device; nothing runs it
    engine = FlowEngine(model, POLICY, cuda_graphs=False)
    engine.core.clock = clock
    results = []

    async def submit(a: dict) -> None:
        results.append(asyncio.ensure_future(engine.submit(request(voice, a), due=a["due"])))
        await asyncio.sleep(0)  # submit() has queued the call

    pending = list(calls)
    runner = FixedCostRunner(model, clock, pending, submit)
    runner.loop = asyncio.get_running_loop()
    engine.runner.close()
    engine.runner = runner
    engine.start()

    def idle() -> bool:
        """The engine waits for calls: none queued, every batch handed to the runner run
        (urgent ones are run inside others) and answered."""
        top = sum(not nested for *_, nested in runner.log)
        done = runner.executor.submitted == top and engine.core.num_batches == len(runner.log)
        return done and not len(engine.core)

    async def until_idle() -> None:
        for _ in range(60000):
            if idle():
                return
            await asyncio.sleep(0.001)
        raise TimeoutError("the engine never went idle")

    try:
        await until_idle()
        while pending:
            a = pending.pop(0)
            clock.now = a["t"]
            await submit(a)
            await until_idle()
        outs = await asyncio.wait_for(asyncio.gather(*results), 60)
        assert len(outs) == len(calls)
    finally:
        await engine.stop()
    return sorted(runner.log)


@pytest.mark.parametrize("deadlines", [False, True], ids=["first-chunks", "deadlines"])
@pytest.mark.parametrize("seed", [0, 1])
async def test_engine_and_simulator_run_the_same_batches(seed, deadlines, monkeypatch):
    calls = arrivals(seed, deadlines)
    sim = simulated(calls)
    real = await served(calls, monkeypatch)
    # the scenario is worth comparing: batches of several calls, and urgent batches between
    # the steps of others
    assert sum(len(b[2]) for b in sim) == len(calls)
    assert len(sim) < len(calls) // 2
    assert any(b[3] for b in sim)
    assert real == sim


class Learning(FakeCost):
    """FakeCost's estimates; remembers what it was taught."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def observe(self, rows: int, padded_len: int, seconds: float) -> None:
        self.seen.append((rows, padded_len, seconds))


def pending_call(frames, due=math.inf, first=False, arrival=0.0) -> PendingCall:
    return PendingCall(frames, frames, first, math.inf, payload=None, arrival=arrival, due=due)


def test_core_yields_by_the_schedulers_rule_on_the_view_it_last_saw():
    """`should_yield` (the engine's runner thread, between two steps) is Scheduler.preempt_due
    on the queue as the core last saw it, and counts the running batch down by one step."""
    clock = FakeClock()
    core = EngineCore(BatchPolicy(max_wait_ms=0.0), Learning(), True, clock)
    core.add(pending_call(1000, due=2.0))
    running = core.begin(core.step().plan)  # 0.1 s, 10 ms a step, its row due at 2.0
    assert (running.step_s, running.remaining_s, running.due) == pytest.approx((0.01, 0.1, 2.0))
    soon = pending_call(200, due=0.2)  # alone 0.02 s: latest start 0.18
    core.add(soon)
    clock.now = 0.01
    assert not core.should_yield(running)  # 0.01 + 0.09 left: it can wait for the batch
    assert running.remaining_s == pytest.approx(0.09)
    clock.now = 0.15
    assert core.should_yield(running)  # 0.15 + 0.08 left > 0.18: it cannot
    stale = core.view
    core.scheduler.waiting.clear()  # a change the core did not see: the view is what it read
    assert core.view is stale and core.should_yield(running)
    core.scheduler.waiting.append(soon)
    step = core.take_urgent(running)
    assert step.plan.calls == [soon] and step.plan.urgent and core.num_preemptions == 1
    assert not core.should_yield(running)  # nothing waits any more


def test_core_batches_with_first_chunks_without_deadline_and_urgent_ones_never_give_way():
    cost = Learning()
    core = EngineCore(BatchPolicy(max_wait_ms=0.0), cost, True, FakeClock())
    first = core.step  # no call yet: nothing to run, ask again when one arrives
    assert first().plan is None and first().wake_at == math.inf
    core.add(pending_call(200, first=True))
    plan = core.step().plan
    assert core.begin(plan) is None
    core.add(pending_call(300))
    later = core.step().plan
    assert core.begin(later) is not None and core.begin(later, nested=True) is None
    assert EngineCore(BatchPolicy(), FakeCost(), False, FakeClock()).begin(later) is None
    core.add(pending_call(200, first=True))  # a first chunk without deadline waits: yield
    assert core.should_yield(core.begin(later))
    # a finished batch teaches the cost model and marks the card busy until now
    core.finish(later, 0.5)
    assert core.num_batches == 1 and core.scheduler.last_busy == 0.0
    assert cost.seen == [(1, 300, 0.5)]
    core.finish(plan, None)  # a failed batch teaches nothing
    assert core.num_batches == 2 and cost.seen == [(1, 300, 0.5)]
