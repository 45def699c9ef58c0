"""Discrete-event simulation of the stack's scheduling on a fake clock (no GPU, no sleeps).

What runs for real: the flow service's `Scheduler` and `CostModel` (the batching, slack order,
preemption decisions), the gateway's `ChunkPlanner` and `PlaybackClock` (chunk shapes, playback
deadlines), the bench's workload (`chunk_needs`, Poisson arrivals) and its metrics
(`bench.metrics.summarize`: first-chunk latency, stack-added stalls). What is modelled:

  flow batch time   `FlowCostFit`: per solver step, a launch floor plus rows x padded frames at
                    a peak rate; fitted to the H200 bf16 runs of 2026-12-03 (B=1 first chunk
                    33 ms, later chunks ~41 ms mean; 64 x 206 frames ~0.55 s; eager steps of
                    more than 8 rows >= 15 ms)
  engine            the loop of flow_service/engine.py: a batch starts when `ready_at` says so;
                    between two solver steps of a preemptible batch, `Scheduler.preempt_due`
                    decides whether an urgent batch (`schedule(urgent_slack_s=...)`) runs nested
  prefix-cache order a stream's call waits for its earlier calls (engine `order_streams`)
  gateway           4 flow calls in flight per stream, chunks to the vocoder in order, a serial
                    gateway CPU cost per delivered chunk, 1 ms of wire each way
  vocoder           one replica, batches of one chunk per session, least slack first,
                    18 ms + 5.5 ms per extra row (fitted: ~25 ms at B=1, ~120 ms at B=20)

`python -m bench.simulate` prints the closed-loop and Poisson figures for the current policy
(`--policy` picks variants); tests/test_simulate.py keeps it honest. Numbers from it are a model,
not measurements: use it to compare policies, then verify on the GPU.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from bench.metrics import StreamRecord, summarize
from bench.workload import chunk_needs, poisson_arrivals
from flow_service.costmodel import CostModel
from flow_service.scheduler import BatchPolicy, PendingCall, Plan, Scheduler
from gateway.deadlines import VOCODER_HOLDBACK_FRAMES, DeadlineConfig, PlaybackClock, slack_ms
from gateway.schedule import LOOKAHEAD_TOKENS, ChunkPlanner, ScheduleConfig
from token2wav import SAMPLE_RATE, SAMPLES_PER_FRAME, TOKEN_MEL_RATIO

NUM_STEPS = 10


@dataclass(frozen=True)
class FlowCostFit:
    launch_s: float = 0.0025  # per step, graphed (<= graph_rows rows)
    eager_floor_s: float = 0.015  # per step, eager batches are launch-bound below this
    frames_per_s: float = 250_000.0  # rows x padded frames per second per step (bf16 H200)
    graph_rows: int = 8
    overhead_s: float = 0.002  # per batch

    def batch_s(self, rows: int, padded_len: int) -> float:
        step = self.launch_s + rows * padded_len / self.frames_per_s
        if rows > self.graph_rows:
            step = max(self.eager_floor_s, step)
        return self.overhead_s + NUM_STEPS * step


@dataclass(frozen=True)
class SimConfig:
    policy: BatchPolicy = BatchPolicy()
    deadlines: DeadlineConfig | None = DeadlineConfig()
    flow_cost: FlowCostFit = FlowCostFit()
    prompt_tokens: int = 75
    utterance_tokens: int = 250
    max_inflight: int = 4
    order_streams: bool = True  # the prefix cache's per-stream order on the replica
    preempt: bool = True
    vocoder_base_s: float = 0.018
    vocoder_row_s: float = 0.0055
    vocoder_max_rows: int = 64
    gateway_chunk_s: float = 0.002  # serial gateway CPU per delivered chunk
    # the gateway's --start-buffer-ms: a first chunk of a stream whose input is still open
    # goes out no earlier than this long after its tokens came (a start buffer)
    start_buffer_s: float = 0.0
    wire_s: float = 0.001


class _Clock:
    def __init__(self):
        self.now = 0.0
        self._events: list = []
        self._ids = itertools.count()

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (max(t, self.now), next(self._ids), fn, args))

    def run(self, until: float = math.inf) -> None:
        while self._events and self._events[0][0] <= until:
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            fn(*args)


@dataclass(eq=False)
class _Stream:
    sid: str
    opened: float
    token_times: list[float]
    planner: ChunkPlanner
    playback: PlaybackClock | None
    rec: StreamRecord
    num_tokens: int = 0
    ended: bool = False
    inflight: int = 0
    pending: deque = field(default_factory=deque)  # planned chunks waiting for a slot
    chain: deque = field(default_factory=deque)  # flow calls waiting for their earlier ones
    chain_busy: bool = False
    mels: dict = field(default_factory=dict)  # seq -> chunk, mel done
    ready: dict = field(default_factory=dict)  # seq -> ready_at
    next_voc: int = 0
    delivered_frames: int = 0
    ended_at_first: bool = False  # the input had ended when the first chunk was planned


class Simulation:
    """One run: `add_stream()` for each stream, then `run()`; `records` feed bench.metrics."""

    def __init__(self, config: SimConfig):
        self.c = config
        self.clock = _Clock()
        self.cost = CostModel(NUM_STEPS)
        self.sched = Scheduler(config.policy, self.cost)
        self.streams: list[_Stream] = []
        self.running: Plan | None = None
        self._wake_pending = math.inf
        self.voc_queue: list = []  # (due, stream, seq)
        self.voc_busy = False
        self.gw_free_at = 0.0
        self.batches: list[dict] = []  # one line per flow batch (for post-mortems)
        self.num_preemptions = 0

    # -- workload ---------------------------------------------------------------------------
    def add_stream(self, sid: str, opened: float, pace: float) -> None:
        n = self.c.utterance_tokens
        times = [opened] * n if pace <= 0 else [opened + i / pace for i in range(n)]
        rec = StreamRecord(sid, n, chunk_needs(self.c.prompt_tokens, n), opened=opened)
        rec.token_sent = list(times)
        rec.end_sent = times[-1]
        clock = (
            PlaybackClock(self.c.deadlines, lambda: self.clock.now) if self.c.deadlines else None
        )
        s = _Stream(
            sid, opened, times, ChunkPlanner(self.c.prompt_tokens, ScheduleConfig()), clock, rec
        )
        self.streams.append(s)
        for i, t in enumerate(times):
            if i + 1 == n or times[i + 1] != t:
                self.clock.at(t, self._tokens_in, s, i + 1, i + 1 == n)

    # -- gateway ----------------------------------------------------------------------------
    def _tokens_in(self, s: _Stream, num: int, ended: bool) -> None:
        s.num_tokens, s.ended = num, ended
        while (chunk := s.planner.next_call(s.num_tokens, s.ended)) is not None:
            now = self.clock.now
            due = s.playback.due(chunk, now) if s.playback else math.inf
            s.ready[chunk.seq] = now
            if chunk.seq == 0:
                s.ended_at_first = s.ended
            s.pending.append((chunk, due))
        self._send_flow(s)

    def _send_flow(self, s: _Stream) -> None:
        while s.pending and s.inflight < self.c.max_inflight:
            chunk, due = s.pending.popleft()
            s.inflight += 1
            self.clock.at(self.clock.now + self.c.wire_s, self._flow_arrives, s, chunk, due)

    def _flow_arrives(self, s: _Stream, chunk, due: float) -> None:
        s.chain.append((chunk, due, self.clock.now))
        self._chain_next(s)

    def _chain_next(self, s: _Stream) -> None:
        if s.chain_busy or not s.chain:
            return
        chunk, due, sent = s.chain.popleft()
        s.chain_busy = self.c.order_streams
        emitted = chunk.num_tokens - (0 if chunk.finalize else LOOKAHEAD_TOKENS)
        frames = TOKEN_MEL_RATIO * (self.c.prompt_tokens + emitted)  # FlowRequest.num_seq_frames
        call = PendingCall(
            num_seq_frames=frames,
            num_out_frames=TOKEN_MEL_RATIO * chunk.num_emit_tokens,
            is_first_chunk=chunk.token_offset == 0,
            deadline=math.inf,
            payload=(s, chunk),
            arrival=self.clock.now,
            due=due if self.c.policy.deadline_scheduling else math.inf,
            stream=s.sid,
            token_offset=chunk.token_offset,
            final=chunk.finalize,
            sent=sent,
        )
        self.sched.add(call)
        if not self.c.order_streams:
            self._chain_next(s)
        self._kick()

    # -- flow engine ------------------------------------------------------------------------
    def _kick(self) -> None:
        if self.running is not None:
            return
        now = self.clock.now
        start = self.sched.ready_at(now)
        if start > now:
            if start < self._wake_pending:
                self._wake_pending = start
                self.clock.at(start, self._wake, start)
            return
        plan = self.sched.schedule(now=now)
        if plan is None:
            return
        self._start(plan)

    def _wake(self, t: float) -> None:
        if self._wake_pending == t:
            self._wake_pending = math.inf
        self._kick()

    def _start(self, plan: Plan) -> None:
        self.running = plan
        total = self.c.flow_cost.batch_s(len(plan.calls), plan.padded_len)
        preemptible = self.c.preempt and not any(
            c.is_first_chunk and c.due == math.inf for c in plan.calls
        )
        step = (total - self.c.flow_cost.overhead_s) / NUM_STEPS
        state = {
            "plan": plan,
            "start": self.clock.now,
            "own": total,
            "nested": 0.0,
            "step": step,
            "steps_left": NUM_STEPS,
            "preemptible": preemptible,
            "est_step": self.cost.step_s(len(plan.calls), plan.padded_len),
        }
        self.clock.at(self.clock.now + self.c.flow_cost.overhead_s + step, self._step_done, state)

    def _step_done(self, state: dict) -> None:
        state["steps_left"] -= 1
        now = self.clock.now
        if state["steps_left"] == 0:
            self._finish(state["plan"], state["start"], state["own"], now)
            self.running = None
            self._kick()
            return
        if state["preemptible"]:
            remaining = state["steps_left"] * state["est_step"]
            running_due = min(c.due for c in state["plan"].calls)
            if self.sched.preempt_due(now, state["est_step"], remaining, running_due):
                plan = self.sched.schedule(
                    now=now,
                    urgent_slack_s=self.sched.urgent_slack(state["est_step"], remaining),
                    due_before=running_due,
                )
                if plan is not None:
                    self.num_preemptions += 1
                    plan.urgent = True
                    t = self.c.flow_cost.batch_s(len(plan.calls), plan.padded_len)
                    state["nested"] += t
                    self.clock.at(now + t, self._nested_done, plan, now, t, state)
                    return
        self.clock.at(now + state["step"], self._step_done, state)

    def _nested_done(self, plan: Plan, started: float, t: float, state: dict) -> None:
        self._finish(plan, started, t, self.clock.now)
        self.clock.at(self.clock.now + state["step"], self._step_done, state)

    def _finish(self, plan: Plan, started: float, own_s: float, now: float) -> None:
        self.sched.mark_busy_until(now)
        self.sched.finished(plan.calls, now)
        self.cost.observe(len(plan.calls), plan.padded_len, own_s)
        self.batches.append(
            {
                "t": round(started, 4),
                "rows": len(plan.calls),
                "padded": plan.padded_len,
                "first": sum(c.is_first_chunk for c in plan.calls),
                "urgent": plan.urgent,
                "s": round(now - started, 4),
                "late": sum(c.due < now for c in plan.calls),
            }
        )
        for call in plan.calls:
            s, chunk = call.payload
            self.clock.at(now + self.c.wire_s, self._mel_back, s, chunk)

    def _mel_back(self, s: _Stream, chunk) -> None:
        s.mels[chunk.seq] = chunk
        if s.chain_busy:
            s.chain_busy = False
            self._chain_next(s)
        while s.next_voc in s.mels:
            seq = s.next_voc
            ch = s.mels.pop(seq)
            due = s.playback.due(ch, s.ready[seq]) if s.playback else math.inf
            self.voc_queue.append((due, s, ch))
            s.next_voc += 1
            s.inflight -= 1
        self._send_flow(s)
        self._voc_kick()

    # -- vocoder and delivery ---------------------------------------------------------------
    def _voc_kick(self) -> None:
        if self.voc_busy or not self.voc_queue:
            return
        now = self.clock.now
        self.voc_queue.sort(key=lambda x: slack_ms(x[0], now) if x[0] < math.inf else 2**31)
        batch, rest, seen = [], [], set()
        for item in self.voc_queue:
            if item[1].sid in seen or len(batch) >= self.c.vocoder_max_rows:
                rest.append(item)
            else:
                seen.add(item[1].sid)
                batch.append(item)
        self.voc_queue = rest
        self.voc_busy = True
        t = self.c.vocoder_base_s + self.c.vocoder_row_s * (len(batch) - 1)
        self.clock.at(now + t, self._voc_done, batch)

    def _voc_done(self, batch) -> None:
        self.voc_busy = False
        now = self.clock.now
        for _, s, chunk in batch:
            start = max(now, self.gw_free_at)
            if chunk.seq == 0 and not s.ended_at_first:
                start = max(start, s.ready[0] + self.c.start_buffer_s)
            self.gw_free_at = start + self.c.gateway_chunk_s
            self.clock.at(self.gw_free_at, self._deliver, s, chunk)
        self._voc_kick()

    def _deliver(self, s: _Stream, chunk) -> None:
        end = TOKEN_MEL_RATIO * (chunk.token_offset + chunk.num_emit_tokens)
        upto = end if chunk.finalize else max(0, end - VOCODER_HOLDBACK_FRAMES)
        frames = upto - s.delivered_frames
        rec = s.rec
        rec.seqs.append(chunk.seq)
        rec.offsets.append(s.delivered_frames * SAMPLES_PER_FRAME)
        rec.num_samples.append(frames * SAMPLES_PER_FRAME)
        rec.arrivals.append(self.clock.now + self.c.wire_s)
        rec.timings.append((0.0,) * 7)
        s.delivered_frames = upto
        if s.playback:
            s.playback.sent(frames * SAMPLES_PER_FRAME / SAMPLE_RATE)
        if chunk.finalize:
            rec.final_seen = True
            rec.closed = self.clock.now + self.c.wire_s

    def run(self) -> list[StreamRecord]:
        self.clock.run()
        return [s.rec for s in self.streams]


def closed_loop(config: SimConfig, streams: int = 64, stagger_s: float = 0.0004) -> dict:
    """`streams` streams opened together (the load generator's spread), tokens all at once."""
    sim = Simulation(config)
    for i in range(streams):
        sim.add_stream(f"c{i}", i * stagger_s, 0.0)
    recs = sim.run()
    return _figures(sim, recs, max(r.closed for r in recs))


def poisson(
    config: SimConfig, rate: float, duration: float = 10.0, pace: float = 0.0, seed: int = 0
) -> dict:
    sim = Simulation(config)
    for i, t in enumerate(poisson_arrivals(seed, rate, duration)):
        sim.add_stream(f"p{i}", float(t), pace)
    recs = sim.run()
    return _figures(sim, recs, duration)


def _figures(sim: Simulation, recs: list[StreamRecord], window: float) -> dict:
    m = summarize(recs, window)
    u = m["underruns"]
    return {
        "streams": m["num_streams"],
        "ok": m["num_ok"],
        "first_chunk_p50_ms": m["first_chunk_ms"]["p50"],
        "first_chunk_p95_ms": m["first_chunk_ms"]["p95"],
        "stack_stalled": u["stack_streams"],
        "excess_p99_ms": u["excess_buffer_ms"]["p99"],
        "batches": len(sim.batches),
        "preemptions": sim.num_preemptions,
        "mean_rows": float(np.mean([b["rows"] for b in sim.batches])),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64, help="closed-loop streams")
    ap.add_argument(
        "--rates", default="3,5,7,9,10,11", help="Poisson rates (streams/s), comma list"
    )
    ap.add_argument("--paces", default="0,50", help="token paces (tokens/s, 0: all at once)")
    ap.add_argument("--duration", type=float, default=10.0, help="Poisson window (s)")
    ap.add_argument("--no-deadlines", action="store_true", help="gateway sends no deadlines")
    ap.add_argument("--batches", action="store_true", help="print the closed loop's batches")
    a = ap.parse_args(argv)
    cfg = SimConfig(deadlines=None if a.no_deadlines else DeadlineConfig())
    out = {"closed": closed_loop(cfg, a.streams)}
    print("closed", a.streams, json.dumps(out["closed"]))
    if a.batches:
        sim = Simulation(cfg)
        for i in range(a.streams):
            sim.add_stream(f"c{i}", i * 0.0004, 0.0)
        sim.run()
        for b in sim.batches:
            print(b)
    for pace in (float(p) for p in a.paces.split(",")):
        for rate in (float(r) for r in a.rates.split(",")):
            f = poisson(cfg, rate, a.duration, pace)
            print(f"pace {pace:g} rate {rate:g}", json.dumps(f))


if __name__ == "__main__":
    main()


__all__ = ["FlowCostFit", "SimConfig", "Simulation", "closed_loop", "poisson", "replace"]
