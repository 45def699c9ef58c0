"""Discrete-event simulation of the stack's scheduling on a fake clock (no GPU, no sleeps).

What runs for real: the flow engine's `EngineCore` with its `Scheduler` and `CostModel` (the
batching, slack order, preemption decisions: flow_service/core.py), its graph row buckets (`graph_rows`), the gateway's `ChunkPlanner` and
`PlaybackClock` (chunk shapes, playback deadlines), the vocoder's graph shape buckets
(`ShapeBuckets`), the bench's workload (`chunk_needs`, Poisson arrivals) and its metrics
(`bench.metrics.summarize`: first-chunk latency and stages, stack-added stalls), the uniform
and the mixed workloads (`WorkloadConfig.shape`, tokens in bursts as bench/loadgen.py sends
them). What is modelled:

  flow batch time   `FlowCostFit`: a CUDA-graphed solve (rows rounded up to the graph row bucket,
                    frames to a multiple of 100) costs a launch floor plus, per row,
                    a term in frames and one in frames^2 (attention); fitted to the H200 bf16
                    solves with fused norms and graphs (docs/bench/2026-12-03-prefix-cache-and-kernels.md "DiT kernels": 8 x 206
                    frames 54 ms, 64 x 206 310, 8 x 656 152, 64 x 656 1085; within 5 ms);
                    batches of more than `graph_rows` (64) rows, or (`graph_max_frames`, the
                    flow's --graph-max-frames) of more rows x longest sequence than that, run
                    eagerly: unpadded, max(a ~300 ms launch floor, the compute of the frames
                    computed), fitted to bench/profile_prefix.py's H200 batches
  prefix cache      per stream: the blocks its calls stored; a streaming call reads them up to
                    its first returned frame and computes only the rest (attending over the
                    whole sequence), storing its complete blocks, eagerly or graphed (the
                    runner's rule: a cached row's work counts half its prefix; a graphed one
                    pays per row x padded prefix frame for the key/value moves, fitted to
                    docs/bench/prefix-graphs-2026-12-04/profile_prefix_blocks.txt); final calls
                    recompute everything (full attention) or, with the gateway's
                    --final-attention=chunked (`schedule`), read as the others do; streams of
                    one voice share its prompt blocks
  graph captures    a graphed batch whose shape (`plain_graph_shapes`, `prefix_graph_key`) the
                    warm-up did not capture pays `graph_capture_s` once, as the runner's
                    GraphedEstimator does, with its least-recently-used limits
  engine            `SimulatedEngine`, the loop of flow_service/engine.py on the fake clock:
                    it runs what the core decides, each batch in NUM_STEPS steps, asking the
                    core between two steps (as the runner does) and running an urgent batch
                    whole there
  prefix-cache order a stream's call waits for its earlier calls (FlowEngine.submit)
  gateway           `gateways` processes, streams round robin; each is one serial CPU: a cost
                    per stream opened (before its first flow call goes out) and per chunk
                    delivered; 4 flow calls in flight per stream, chunks to the vocoder in
                    order, 1 ms of wire each way; the start buffer (`start_buffer_s`, the
                    gateway's --start-buffer-ms, pipeline.py `_hold_first`) holds a stream's
                    first audio while its input is open, without holding the gateway's CPU
  admission         the gateway's own `AdmissionController` per gateway process (fake clock),
                    its `CapacityBoard` fed with the simulated flow `CostModel`'s learned
                    capacity on every flow answer, each stream seen through
                    gateway/admission.py `remaining_work`, as the pipeline's; refused
                    streams end at once (RESOURCE_EXHAUSTED)
  vocoder           one replica, `SessionManager.take_ready`'s policy: one chunk per session,
                    earliest due first, urgent batches (`urgent_slack_s`, `urgent_max_frames`),
                    `max_wait_s` to fill; `VocoderCostFit`: graphed batches (rows and decoder
                    window frames padded to the service's buckets) cost a floor plus rows x
                    frames, fitted to H200 graph replays (one first chunk ~5 ms, 24 first
                    chunks ~23 ms, 24 x 100-frame chunks ~56 ms); more than 32 rows run eagerly

`python -m bench simulate` prints the closed-loop and Poisson figures for the current policy
(flags pick variants: the services' knobs), or with `--overload` one run through admission.
tests/test_simulate.py keeps it honest, and tests/test_engine_core.py holds its flow engine
to the service's. Numbers from it are a model, not measurements: use it to compare policies,
then verify on the GPU.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import re
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from bench.metrics import StreamRecord, summarize
from bench.workload import StreamShape, WorkloadConfig, chunk_needs, poisson_arrivals
from flow_service.config import FlowConfig
from flow_service.core import EngineCore, Running
from flow_service.costmodel import CostModel
from flow_service.model.config import BLOCK_FRAMES, FLOW_PRESETS, NUM_STEPS
from flow_service.model.prefix_cache import prompt_blocks, readable_prefix, scratch_query_blocks
from flow_service.runner import (
    GRAPH_FRAME_MULTIPLE,
    GRAPH_PREFIX_MULTIPLE,
    PLAIN_GRAPHS_KEPT,
    PREFIX_GRAPHS_SPARE,
    WARMUP_MAX_PREFIX,
    graph_fits,
    graph_rows,
    plain_graph_shapes,
    prefix_graph_key,
    prefix_graph_shapes,
)
from flow_service.scheduler import BatchPolicy, PendingCall, Plan
from gateway.admission import (
    AdmissionConfig,
    AdmissionController,
    CapacityBoard,
    remaining_work,
)
from gateway.deadlines import VOCODER_HOLDBACK_FRAMES, DeadlineConfig, PlaybackClock
from gateway.pipeline import PipelineLimits
from gateway.schedule import LOOKAHEAD_TOKENS, BlockPlanner, ChunkPlanner, ScheduleConfig
from token2wav import SAMPLE_RATE, SAMPLES_PER_FRAME, TOKEN_MEL_RATIO
from token2wav.errors import ResourceExhausted
from vocoder_service.batch_policy import batch_order, fits
from vocoder_service.model.config import HIFT_PRESETS
from vocoder_service.model.graphs import ShapeBuckets


@dataclass(frozen=True)
class FlowCostFit:
    """A flow batch's seconds on an H200 (bf16, fused norms). `solve_s` is the fit of a whole
    graphed solve (10 steps) at an exact shape; `batch_s` adds the service's graph buckets."""

    solve_floor_s: float = 0.019  # per graphed solve: launches
    row_frame_s: float = 2.047e-5  # per row x frame, per solve
    row_frame2_s: float = 7.495e-9  # per row x frame^2, per solve (attention)
    graph_rows: int = FlowConfig.graph_max_batch  # the flow's --graph-max-batch
    # Eager solves (bench/profile_prefix.py on an H200, bf16, fused norms, 10 s streams' calls
    # 0/1/2/final at 16-64 rows): max(a launch-bound floor, the compute of the frames actually
    # computed). The floor is ~300 ms a solve, measured 214-406 ms where compute is small (the
    # spread is run to run); compute runs at ~0.39-0.43 M frame-steps/s at 64 rows, the graphed
    # rate (64 x 206 / 656 frames: 305 / 1080 ms eager against 310 / 1153 graphed but padded)
    eager_floor_s: float = 0.30
    eager_factor: float = 1.0
    # an eager call that fills prefix-cache blocks writes their keys/values at every step: 64
    # rows x 200 stored frames cost ~45 ms (call 0: 350 ms with the cache, 305 without)
    store_frame_s: float = 3.5e-6  # per row x stored frame, per solve
    # a graphed solve over the cache moves each row's padded prefix's keys/values per layer:
    # 7-14 us per row x prefix frame a solve at 8-64 rows of block calls over 200-600-frame
    # prefixes, above the queries' own `solve_s` (profile_prefix_blocks.txt, 2026-12-04)
    prefix_frame_s: float = 1.0e-5
    overhead_s: float = 0.002  # per batch (host side: prepare, scatter)

    def solve_s(self, rows: int, frames: int) -> float:
        per_row = self.row_frame_s * frames + self.row_frame2_s * frames * frames
        return self.solve_floor_s + rows * per_row

    def graphed_s(self, rows: int, padded_len: int) -> float:
        """A CUDA-graphed batch: rows to the graph row bucket, frames to a multiple of 100."""
        frames = -(-padded_len // GRAPH_FRAME_MULTIPLE) * GRAPH_FRAME_MULTIPLE
        return self.overhead_s + self.solve_s(graph_rows(rows), frames)

    def eager_s(
        self, rows: int, padded_len: int, queries: int | None = None, stored: int = 0
    ) -> float:
        """An eager batch, unpadded: `queries` frames per row computed (the longest row's
        frames after its cached prefix; None: all of them) attending over `padded_len`, and
        `stored` row frames written to the prefix cache."""
        q = padded_len if queries is None else queries
        per_row = self.row_frame_s * q + self.row_frame2_s * q * padded_len
        compute = self.eager_factor * (self.solve_floor_s + rows * per_row)
        return self.overhead_s + max(self.eager_floor_s, compute + self.store_frame_s * stored)

    def prefix_graphed_s(self, rows: int, queries: int, prefix: int) -> float:
        """A graphed batch over the prefix cache: the longest row's `queries` to whole blocks
        and its `prefix` to the runner's multiple (flow_service/runner.py
        GRAPH_PREFIX_MULTIPLE), rows to the graph row bucket."""
        q = -(-queries // BLOCK_FRAMES) * BLOCK_FRAMES
        p = -(-prefix // GRAPH_PREFIX_MULTIPLE) * GRAPH_PREFIX_MULTIPLE
        padded = graph_rows(rows)
        return self.overhead_s + self.solve_s(padded, q) + padded * self.prefix_frame_s * p

    def batch_s(self, rows: int, padded_len: int) -> float:
        """Without the prefix cache or a frame bound: graphed up to `graph_rows` rows."""
        if rows <= self.graph_rows:
            return self.graphed_s(rows, padded_len)
        return self.eager_s(rows, padded_len)


VOCODER_BUCKETS = ShapeBuckets.for_limits()  # the vocoder service's defaults (32 rows, 16, 256)
VOCODER_CONTEXT = HIFT_PRESETS["cosyvoice3-0.5b"].context_frames()


def vocoder_window(chunk) -> int:
    """Mel frames in the HiFT decoder window of `chunk` (vocoder_service/model/session.py
    `decode_window`): the new frames, the previous chunk's held-back ones, the left context."""
    frames = TOKEN_MEL_RATIO * chunk.num_emit_tokens
    if chunk.seq == 0:
        return frames if chunk.finalize else frames - VOCODER_HOLDBACK_FRAMES + 1
    return frames + VOCODER_CONTEXT + (VOCODER_HOLDBACK_FRAMES if chunk.finalize else 1)


@dataclass(frozen=True)
class VocoderCostFit:
    """A vocoder batch's seconds on an H200: graph replays of padded (rows, window frames)."""

    base_s: float = 0.0049  # a graph replay's floor
    row_frame_s: float = 1.487e-5  # per padded row x window frame
    eager_floor_s: float = 0.018  # an eager batch (~900 launches)
    # per batch, host side in the stack (f0, copies, answers): one stream's first chunk took
    # 10.3 ms of vocoder compute in the fifth run against ~5 ms of graph replay
    host_s: float = 0.005

    def batch_s(self, windows: list[int]) -> float:
        rows, frames = len(windows), max(windows)
        if VOCODER_BUCKETS.bucketed(VOCODER_BUCKETS.rows(rows), VOCODER_BUCKETS.frames(frames)):
            rows, frames = VOCODER_BUCKETS.rows(rows), VOCODER_BUCKETS.frames(frames)
            return self.host_s + self.base_s + self.row_frame_s * rows * frames
        return self.host_s + max(self.eager_floor_s, self.base_s + self.row_frame_s * rows * frames)


@dataclass(frozen=True)
class SimConfig:
    policy: BatchPolicy = BatchPolicy()
    deadlines: DeadlineConfig | None = DeadlineConfig()
    flow_cost: FlowCostFit = FlowCostFit()
    vocoder_cost: VocoderCostFit = VocoderCostFit()
    prompt_tokens: int = 75
    utterance_tokens: int = 250
    max_inflight: int = PipelineLimits.max_inflight_chunks
    # the gateway's --block-calls: a chunk's 25-token blocks are flow calls of their own, sent
    # as their tokens + 3 come in (max_inflight of them out at once), and the chunk goes to
    # the vocoder once all of its blocks are back; the final call waits for every block
    block_calls: bool = PipelineLimits.block_calls
    # the streams' chunk schedule (the gateway's --schedule and --final-attention): with
    # chunked_final the last call reads the prefix cache as a streaming call does
    schedule: ScheduleConfig = PipelineLimits.schedule
    order_streams: bool = True  # the prefix cache's per-stream order on the replica
    preempt: bool = True
    # the vocoder's BatcherConfig: sessions per batch, wait to fill, urgent batches
    vocoder_max_rows: int = 64
    vocoder_max_wait_s: float = 0.002
    vocoder_urgent_slack_s: float = 0.1
    vocoder_urgent_max_frames: int = 1600
    # gateway processes (the bench's --gateways; 4 in the fifth H200 run), streams round
    # robin, each one serial CPU. gateway_stream_s is fitted to that run's closed loop (first
    # chunks' gateway stage 144 ms with 16 streams per gateway opening at once); the 2-core CPU
    # box measured 5.9-6.7 ms of gateway CPU per stream (bench/gateway_overhead.py)
    gateways: int = 4
    gateway_stream_s: float = 0.016  # per stream opened, before its first flow call
    gateway_chunk_s: float = 0.002  # per delivered chunk
    # the gateway's --start-buffer-ms, as bench/run_capacity_gpu.sh sets it: a first chunk of
    # a stream whose input is still open goes out no earlier than this long after its tokens
    start_buffer_s: float = 0.15
    wire_s: float = 0.001
    # flow and vocoder share the GPU: a vocoder batch of t seconds delays the running flow
    # batch by gpu_share x t (0: independent devices). 1 fitted the fifth H200 run's closed
    # loop (first chunks' flow compute 142 ms against ~110 ms with 0.5). 0.5 fits the H100's
    # of 2026-12-07 as well (xRT 218 simulated, 221 measured; 202 at 1) and its mixed
    # workload far better: 89.0 / 83.0 % of streams unstalled at 9 / 12 streams/s (seed 0, the
    # bench's) against 96.6 / 87.9 % on time measured, where 1 gave 75.3 / 57.0 %
    # (docs/bench/2026-12-07-h100-evening.md). A vocoder batch's time is partly host work
    # (prep, the f0 predictor's copies, audio back), during which the flow has the card.
    gpu_share: float = 0.5
    # the flow's --graph-max-frames (flow_service/runner.py `FlowRunner.graphed`): a batch of
    # at most graph_rows rows replays CUDA graphs only if rows x its longest sequence is at most
    # this; otherwise it runs eagerly, unpadded, with the prefix cache. 0: no bound (graphs up
    # to graph_rows rows, as before 2026-12-03's sixth run)
    graph_max_frames: int = FlowConfig.graph_max_frames
    # the gateway's admission control (--admission...; enabled=False: every stream admitted),
    # one controller per gateway process
    admission: AdmissionConfig = AdmissionConfig()
    # A graphed batch whose shape has no graph yet captures one first (FlowRunner: the
    # warm-up's shapes, `plain_graph_shapes` and `prefix_graph_shapes` up to
    # `warmup_max_prefix`, are there from the start; least recently used ones go past
    # PLAIN_GRAPHS_KEPT, or PREFIX_GRAPHS_SPARE more than the warm-up's). Its cost: the H100's
    # one-row first chunk, 156 ms in the first batch that met its shape and 29.7 ms later
    # (docs/bench/2026-12-06-h100.md).
    graph_capture_s: float = 0.126
    warmup_max_prefix: int = WARMUP_MAX_PREFIX


class EventClock:
    """The simulated clock: `at(t, fn, *args)` queues an event, `run()` plays them in time
    order (ties in the order queued)."""

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


class SimulatedEngine:
    """flow_service/engine.py's loop on the simulated clock: its `EngineCore` decides what
    runs and when, as in the service. A batch takes `batch_s(plan)` seconds, `overhead_s` and
    then NUM_STEPS equal solver steps; between two steps a batch that may give way asks the
    core, as the runner does, and an urgent batch then runs whole. `done(plan, started, now)`
    hears of each batch as it ends, after the core. `debt`: seconds the running batch lost to
    other work on the GPU (the vocoder), paid before its next event."""

    def __init__(
        self,
        core: EngineCore,
        clock: EventClock,
        batch_s: Callable[[Plan], float],
        overhead_s: float = 0.0,
        done: Callable[[Plan, float, float], None] = lambda plan, started, now: None,
    ):
        self.core = core
        self.clock = clock
        self.batch_s = batch_s
        self.overhead_s = overhead_s
        self.done = done
        self.running: Plan | None = None
        self.debt = 0.0
        self._wake_at = math.inf

    def add(self, call: PendingCall) -> None:
        self.core.add(call)
        self._kick()

    def _kick(self) -> None:
        if self.running is not None:
            return
        step = self.core.step()
        if step.plan is not None:
            self._start(step.plan)
        elif step.wake_at < self._wake_at:
            self._wake_at = step.wake_at
            self.clock.at(step.wake_at, self._wake, step.wake_at)

    def _wake(self, t: float) -> None:
        if self._wake_at == t:
            self._wake_at = math.inf
        self._kick()

    def _start(self, plan: Plan) -> None:
        self.running = plan
        now = self.clock.now
        step = (self.batch_s(plan) - self.overhead_s) / NUM_STEPS
        state = _Batch(plan, now, step, NUM_STEPS, self.core.begin(plan))
        self.clock.at(now + self.overhead_s + step, self._step_done, state)

    def _deferred(self, fn, *args) -> bool:
        """An event that is due now but lost GPU time meanwhile: later."""
        if self.debt <= 0:
            return False
        self.clock.at(self.clock.now + self.debt, fn, *args)
        self.debt = 0.0
        return True

    def _step_done(self, b: _Batch) -> None:
        if self._deferred(self._step_done, b):
            return
        b.steps_left -= 1
        now = self.clock.now
        if b.steps_left == 0:
            self.running = None
            self.core.finish(b.plan, now - b.started - b.nested_s)
            self.done(b.plan, b.started, now)
            self._kick()
            return
        if b.running is not None and self.core.should_yield(b.running):
            urgent = self.core.take_urgent(b.running).plan
            if urgent is not None:
                self.clock.at(now + self.batch_s(urgent), self._urgent_done, urgent, now, b)
                return
        self.clock.at(now + b.step_s, self._step_done, b)

    def _urgent_done(self, plan: Plan, started: float, b: _Batch) -> None:
        if self._deferred(self._urgent_done, plan, started, b):
            return
        now = self.clock.now
        b.nested_s += now - started
        self.core.finish(plan, now - started)
        self.done(plan, started, now)
        self.clock.at(now + b.step_s, self._step_done, b)


@dataclass(eq=False)
class _Batch:
    """A flow batch in progress in the simulation."""

    plan: Plan
    started: float
    step_s: float  # simulated seconds a solver step
    steps_left: int
    running: Running | None  # the core's, where the batch may give way between steps
    nested_s: float = 0.0  # urgent batches run between its steps


class _Admitted:
    """A simulated stream as the gateway's admission sees it (`admission.Workload`): its work
    left by gateway/admission.py `remaining_work`, as `StreamPipeline.remaining_work` gives
    it."""

    def __init__(self, s: _Stream, prompt_tokens: int):
        self.s = s
        self.prompt_tokens = prompt_tokens

    def remaining_work(self, now: float, expected_tokens: int) -> list[tuple[float, int]]:
        s = self.s
        in_flight = [(chunk, due, s.ready[seq]) for seq, (chunk, due) in s.unanswered.items()]
        return remaining_work(
            s.planner,
            s.playback,
            self.prompt_tokens,
            in_flight,
            s.num_tokens,
            s.ended,
            now,
            expected_tokens,
        )


def _now(coro):
    """Run a coroutine that never waits (admission with max_wait 0) to its end, loop-free."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("admission waited: the simulation supports --admission-max-wait-ms 0")


@dataclass(eq=False)
class _Stream:
    sid: str
    opened: float
    token_times: list[float]
    planner: ChunkPlanner
    playback: PlaybackClock | None
    rec: StreamRecord
    prompt_tokens: int
    voice: object  # streams of one voice share its prompt blocks in the prefix cache
    gateway: int = 0
    num_tokens: int = 0
    ended: bool = False
    open_done: bool = False  # its gateway has taken the stream in (flow calls may go out)
    refused: bool = False  # admission refused it (RESOURCE_EXHAUSTED)
    inflight: int = 0
    pending: deque = field(default_factory=deque)  # planned chunks waiting for a slot
    chain: deque = field(default_factory=deque)  # flow calls waiting for their earlier ones
    chain_busy: bool = False
    mels: dict = field(default_factory=dict)  # seq -> chunk, mel done
    ready: dict = field(default_factory=dict)  # seq -> ready_at
    stages: dict = field(default_factory=dict)  # seq -> flow in, start, done, rows, vocoder same
    next_voc: int = 0
    delivered_frames: int = 0
    out_free_at: float = 0.0  # the stream's chunks go out in order (the start buffer holds it)
    cached_frames: int = 0  # prefix-cache blocks stored for it by its eager calls, in frames
    # seq -> (chunk, the due sent with it; None without deadlines): planned, flow not answered
    unanswered: dict = field(default_factory=dict)
    admitted: _Admitted | None = None  # what admission sees of it, while admitted
    # block calls (SimConfig.block_calls)
    blocks: BlockPlanner | None = None
    block_inflight: int = 0
    blocks_planned: bool = False  # every block call the input allows has gone out
    # start token -> (end token, started, done, rows) of each block whose mel is back
    block_done: dict = field(default_factory=dict)
    assembling: deque = field(default_factory=deque)  # chunks waiting for their blocks
    final_held: tuple | None = None  # (final chunk, due) waiting for the last block


class Simulation:
    """One run: `add_stream()` for each stream, then `run()`; `records` feed bench.metrics."""

    def __init__(self, config: SimConfig):
        self.c = config
        self.clock = EventClock()
        self.cost = CostModel(NUM_STEPS)
        core = EngineCore(config.policy, self.cost, config.preempt, lambda: self.clock.now)
        self.flow = SimulatedEngine(
            core, self.clock, self._batch_s, config.flow_cost.overhead_s, self._batch_done
        )
        self.streams: list[_Stream] = []
        self.voc_queue: list = []  # (due, stream, chunk, ready at the vocoder)
        self.voc_busy = False
        self._voc_wake = math.inf
        self.gw_free_at = [0.0] * max(1, config.gateways)
        # per gateway process: the replicas' reported capacity and the admission controller
        self.boards = [CapacityBoard(lambda: self.clock.now) for _ in self.gw_free_at]
        self.admission = [
            AdmissionController(config.admission, b, lambda: self.clock.now) for b in self.boards
        ]
        self.refused = 0
        self.batches: list[dict] = []  # one line per flow batch (for post-mortems)
        self.voc_batches: list[dict] = []
        self._cache_plans: dict = {}  # id(plan) -> prefix-cache stores (None: graphed)
        self.seq_frames = 0  # flow batches' rows x sequence frames (padding excluded)
        self.computed_frames = 0  # of which computed (the prefix cache's hits excluded)
        rows, bound = config.flow_cost.graph_rows, config.graph_max_frames
        scratch = scratch_query_blocks(NUM_STEPS, FLOW_PRESETS["cosyvoice3-0.5b"].dit.depth)
        warm_prefix = prefix_graph_shapes(
            rows, bound, BLOCK_FRAMES, scratch, config.warmup_max_prefix
        )
        # shape key -> None, least recently replayed first, as the runner's GraphedEstimators
        self.graphs = {
            "plain": (
                dict.fromkeys(plain_graph_shapes(rows, bound, GRAPH_FRAME_MULTIPLE)),
                PLAIN_GRAPHS_KEPT,
            ),
            "prefix": (dict.fromkeys(warm_prefix), len(warm_prefix) + PREFIX_GRAPHS_SPARE),
        }
        self.captures = {"plain": 0, "prefix": 0}  # graphs captured inside a batch
        self.voice_frames: dict = {}  # voice -> frames of its prompt blocks in the cache

    # -- workload ---------------------------------------------------------------------------
    def add_stream(
        self, sid: str, opened: float, pace: float, shape: StreamShape | None = None
    ) -> None:
        """A stream of the config's prompt and length at `pace` (each its own voice), or of
        `shape` (its voice, prompt, length and pace; tokens in bursts, as bench/loadgen.py
        sends them)."""
        voice = sid if shape is None else shape.voice
        if shape is None:
            shape = StreamShape(0, self.c.prompt_tokens, self.c.utterance_tokens, pace, 1)
        n, pace, burst = shape.utterance_tokens, shape.pace, shape.burst
        if pace <= 0:
            times = [opened] * n
        else:  # a burst goes out when its last token is due
            times = [opened + (min(n, i // burst * burst + burst) - 1) / pace for i in range(n)]
        needs = chunk_needs(shape.prompt_tokens, n, self.c.schedule)
        rec = StreamRecord(sid, n, needs, opened=opened)
        rec.token_sent = list(times)
        rec.end_sent = times[-1]
        clock = (
            PlaybackClock(self.c.deadlines, lambda: self.clock.now) if self.c.deadlines else None
        )
        planner = ChunkPlanner(shape.prompt_tokens, self.c.schedule)
        gw = len(self.streams) % len(self.gw_free_at)
        s = _Stream(sid, opened, times, planner, clock, rec, shape.prompt_tokens, voice, gw)
        if self.c.block_calls:
            s.blocks = BlockPlanner(shape.prompt_tokens, self.c.schedule)
        self.streams.append(s)
        self.clock.at(opened, self._open, s)
        for i, t in enumerate(times):
            if i + 1 == n or times[i + 1] != t:
                self.clock.at(t, self._tokens_in, s, i + 1, i + 1 == n)

    # -- gateway ----------------------------------------------------------------------------
    def _gateway_cpu(self, s: _Stream, seconds: float) -> float:
        """Serial CPU on the stream's gateway from now: when it is done."""
        start = max(self.clock.now, self.gw_free_at[s.gateway])
        self.gw_free_at[s.gateway] = start + seconds
        return start + seconds

    def _open(self, s: _Stream) -> None:
        if self.c.admission.enabled:  # gateway/servicer.py: admit before the pipeline runs
            admitted = _Admitted(s, s.prompt_tokens)
            try:
                _now(self.admission[s.gateway].admit(admitted))
            except ResourceExhausted as exc:
                s.refused, self.refused = True, self.refused + 1
                s.rec.status, s.rec.detail = "RESOURCE_EXHAUSTED", str(exc)
                s.rec.closed = self.clock.now + 2 * self.c.wire_s
                return
            s.admitted = admitted
        self.clock.at(self._gateway_cpu(s, self.c.gateway_stream_s), self._opened, s)

    def _opened(self, s: _Stream) -> None:
        s.open_done = True
        self._send_blocks(s)
        self._send_flow(s)

    def _tokens_in(self, s: _Stream, num: int, ended: bool) -> None:
        if s.refused:
            return
        s.num_tokens, s.ended = num, ended
        while (chunk := s.planner.next_call(s.num_tokens, s.ended)) is not None:
            now = self.clock.now
            due = s.playback.due(chunk, now) if s.playback else math.inf
            s.ready[chunk.seq] = now
            s.pending.append((chunk, due))
            s.unanswered[chunk.seq] = (chunk, due if s.playback else None)
        self._send_blocks(s)
        self._send_flow(s)

    def _send_flow(self, s: _Stream) -> None:
        while s.open_done and s.pending and s.inflight < self.c.max_inflight:
            chunk, due = s.pending.popleft()
            s.inflight += 1
            if s.blocks is None:
                self.clock.at(self.clock.now + self.c.wire_s, self._flow_arrives, s, chunk, due)
            elif chunk.finalize:
                s.final_held = (chunk, due)
                self._send_final(s)
            else:
                s.assembling.append(chunk)
                self._assemble(s)

    def _send_blocks(self, s: _Stream) -> None:
        """gateway/pipeline.py `_compute_blocks`: the block calls the tokens allow."""
        if s.blocks is None or not s.open_done:
            return
        wanted = s.blocks.streaming_end(s.num_tokens) if s.ended else s.num_tokens
        while s.block_inflight < self.c.max_inflight:
            call = s.blocks.next_call(wanted)
            if call is None:
                s.blocks_planned = s.ended
                break
            s.block_inflight += 1
            now = self.clock.now
            chunk = s.blocks.chunk_of(call.token_offset)
            due = s.playback.due(chunk, now, project=True) if s.playback else math.inf
            self.clock.at(now + self.c.wire_s, self._flow_arrives, s, call, due, True)

    def _send_final(self, s: _Stream) -> None:
        if s.final_held is not None and s.blocks_planned and s.block_inflight == 0:
            (chunk, due), s.final_held = s.final_held, None
            self.clock.at(self.clock.now + self.c.wire_s, self._flow_arrives, s, chunk, due)

    def _assemble(self, s: _Stream) -> None:
        """gateway/pipeline.py `_assemble`: a chunk is ready once its blocks are back."""
        while s.assembling:
            chunk = s.assembling[0]
            start, end, last = chunk.token_offset, chunk.num_tokens - LOOKAHEAD_TOKENS, None
            while start < end and start in s.block_done:
                last = s.block_done[start]
                start = last[0]
            if start < end:
                return
            s.assembling.popleft()
            _, started, done, rows = last
            s.stages[chunk.seq] = [min(started, s.ready[chunk.seq]), started, done, rows]
            self._chunk_mel(s, chunk)

    def _flow_arrives(self, s: _Stream, chunk, due: float, block: bool = False) -> None:
        if not block:
            s.stages[chunk.seq] = [self.clock.now]
        s.chain.append((chunk, due, self.clock.now, block))
        self._chain_next(s)

    def _chain_next(self, s: _Stream) -> None:
        if s.chain_busy or not s.chain:
            return
        chunk, due, sent, block = s.chain.popleft()
        s.chain_busy = self.c.order_streams
        emitted = chunk.num_tokens - (0 if chunk.finalize else LOOKAHEAD_TOKENS)
        frames = TOKEN_MEL_RATIO * (s.prompt_tokens + emitted)  # FlowRequest.num_seq_frames
        call = PendingCall(
            num_seq_frames=frames,
            num_out_frames=TOKEN_MEL_RATIO * chunk.num_emit_tokens,
            is_first_chunk=chunk.token_offset == 0,
            deadline=math.inf,
            payload=(s, chunk, block),
            arrival=self.clock.now,
            due=due,
            stream=s.sid,
            token_offset=chunk.token_offset,
            final=chunk.finalize,
            num_cached_frames=self._readable(s, chunk, frames),
            sent=sent,
        )
        self.flow.add(call)
        if not self.c.order_streams:
            self._chain_next(s)

    # -- flow engine ------------------------------------------------------------------------
    def graphed(self, plan: Plan, prefixes: list[int] | None = None) -> bool:
        """flow_service/runner.py `FlowRunner.graphed`: graphs up to graph_rows rows and,
        with graph_max_frames, up to that many rows x longest work: sequence frames, less half
        of each row's cached prefix when the batch reads the cache."""
        longest = plan.padded_len
        if prefixes is not None:
            longest = max(
                c.num_seq_frames - p // 2 for c, p in zip(plan.calls, prefixes, strict=True)
            )
        return graph_fits(
            len(plan.calls), longest, self.c.flow_cost.graph_rows, self.c.graph_max_frames
        )

    def _batch_s(self, plan: Plan) -> float:
        """Seconds of `plan` alone, with the prefix cache (flow_service/model/prefix_cache.py
        `PrefixCache.plan`: a streaming call reads the blocks its stream's earlier calls
        stored, up to its first returned frame, and stores its sequence's complete blocks; a
        final call reads nothing), graphed or eagerly as the runner picks."""
        fit = self.c.flow_cost
        frames = [c.num_seq_frames for c in plan.calls]
        self.seq_frames += sum(frames)
        prefixes, stored, stores = [], 0, []
        for call in plan.calls:
            s, chunk, _ = call.payload
            prefix = 0
            if chunk.streaming:  # a final call with full attention reads nothing
                limit = self._readable(s, chunk, call.num_seq_frames)
                cached = max(s.cached_frames, self.voice_frames.get(s.voice, 0))
                prefix = min(cached, limit)
                end = call.num_seq_frames // BLOCK_FRAMES * BLOCK_FRAMES
                if end > prefix and not call.final:  # a final call stores nothing
                    stored += end - prefix
                    stores.append((s, end))
            prefixes.append(prefix)
        queries = max(f - p for f, p in zip(frames, prefixes, strict=True))
        self.computed_frames += sum(frames) - sum(prefixes)
        rows = len(plan.calls)
        if not stores and not any(prefixes):  # the cache takes no part: plain graphs or eager
            graphed = self.graphed(plan)
            self._cache_plans[id(plan)] = ((), graphed)
            if graphed:
                padded = -(-plan.padded_len // GRAPH_FRAME_MULTIPLE) * GRAPH_FRAME_MULTIPLE
                capture = self._replay("plain", (graph_rows(rows), padded))
                return capture + fit.graphed_s(rows, plan.padded_len)
            return fit.eager_s(rows, plan.padded_len)
        graphed = self.graphed(plan, prefixes)
        self._cache_plans[id(plan)] = (stores, graphed)
        if graphed:
            key = prefix_graph_key(rows, max(prefixes), queries, BLOCK_FRAMES)
            return self._replay("prefix", key) + fit.prefix_graphed_s(rows, key[2], max(prefixes))
        return fit.eager_s(rows, plan.padded_len, queries, stored)

    @staticmethod
    def _readable(s: _Stream, chunk, num_seq_frames: int) -> int:
        """prefix_cache.readable_prefix of a call: a final call with full attention reads
        nothing, streaming calls (a chunked final too) read up to their first frame."""
        out_start = TOKEN_MEL_RATIO * (s.prompt_tokens + chunk.token_offset)
        return readable_prefix(out_start, num_seq_frames, chunk.streaming, BLOCK_FRAMES)

    def _replay(self, kind: str, key: tuple) -> float:
        """A graphed batch replays the graph of `key`: the seconds of capturing it first, if
        it has none (the least recently replayed graph then goes, past the runner's limit)."""
        graphs, kept = self.graphs[kind]
        if key in graphs:
            graphs[key] = graphs.pop(key)  # most recently used last
            return 0.0
        while len(graphs) >= kept:
            del graphs[next(iter(graphs))]
        graphs[key] = None
        self.captures[kind] += 1
        return self.c.graph_capture_s

    def _commit_cache(self, plan: Plan) -> bool:
        """After `plan`'s solve: its rows' blocks are stored. Whether it was graphed."""
        stores, graphed = self._cache_plans.pop(id(plan))
        for s, end in stores:
            s.cached_frames = max(s.cached_frames, end)
            blocks = prompt_blocks(s.prompt_tokens, TOKEN_MEL_RATIO, LOOKAHEAD_TOKENS, BLOCK_FRAMES)
            voice = min(end, blocks * BLOCK_FRAMES)  # the voice entry's, once they are stored
            if voice > self.voice_frames.get(s.voice, 0):
                self.voice_frames[s.voice] = voice
        return graphed

    def _batch_done(self, plan: Plan, started: float, now: float) -> None:
        graphed = self._commit_cache(plan)
        self.batches.append(
            {
                "t": round(started, 4),
                "rows": len(plan.calls),
                "padded": plan.padded_len,
                "first": sum(c.is_first_chunk for c in plan.calls),
                "urgent": plan.urgent,
                "s": round(now - started, 4),
                "late": sum(c.due < now for c in plan.calls),
                "graphed": graphed,
                "left_out": plan.left_out,
            }
        )
        for call in plan.calls:
            s, chunk, block = call.payload
            if block:
                s.block_done[chunk.token_offset] = (
                    chunk.num_tokens - LOOKAHEAD_TOKENS,
                    started,
                    now,
                    len(plan.calls),
                )
            else:
                s.stages[chunk.seq] += [started, now, len(plan.calls)]
            self.clock.at(now + self.c.wire_s, self._mel_back, s, chunk, block)

    def _mel_back(self, s: _Stream, chunk, block: bool = False) -> None:
        # gateway/downstream.py: each flow answer carries the replica's learned capacity
        self.boards[s.gateway].report("flow", self.cost.capacity_frames_per_s)
        if s.chain_busy:
            s.chain_busy = False
            self._chain_next(s)
        if not block:
            self._chunk_mel(s, chunk)
            return
        s.block_inflight -= 1
        self._assemble(s)
        self._send_blocks(s)
        self._send_final(s)

    def _chunk_mel(self, s: _Stream, chunk) -> None:
        """A chunk's mel is in the gateway: chunks go to the vocoder in order."""
        s.mels[chunk.seq] = chunk
        s.unanswered.pop(chunk.seq, None)
        while s.next_voc in s.mels:
            seq = s.next_voc
            ch = s.mels.pop(seq)
            due = s.playback.due(ch, s.ready[seq]) if s.playback else math.inf
            self.clock.at(self.clock.now + self.c.wire_s, self._voc_arrives, due, s, ch)
            s.next_voc += 1
            s.inflight -= 1
        self._send_flow(s)

    # -- vocoder and delivery ---------------------------------------------------------------
    def _voc_arrives(self, due: float, s: _Stream, chunk) -> None:
        s.stages[chunk.seq].append(self.clock.now)
        self.voc_queue.append((due, s, chunk, self.clock.now))
        self._voc_kick()

    def _voc_take(self, now: float) -> list:
        """The vocoder's batch: one chunk per session (its earliest), picked by the service's
        own rule (vocoder_service/batch_policy.py)."""
        firsts: dict = {}
        for item in self.voc_queue:  # arrival order; a session's chunks arrive in seq order
            firsts.setdefault(item[1].sid, item)
        ready = list(firsts.values())
        c = self.c
        picks, urgent = batch_order([x[0] for x in ready], now, c.vocoder_urgent_slack_s)
        batch, longest = [], 0
        for item in (ready[i] for i in picks):
            if len(batch) >= c.vocoder_max_rows:
                break
            frames = TOKEN_MEL_RATIO * item[2].num_emit_tokens
            if not fits(len(batch), longest, frames, urgent, c.vocoder_urgent_max_frames):
                break
            batch.append(item)
            longest = max(longest, frames)
        taken = set(map(id, batch))
        self.voc_queue = [x for x in self.voc_queue if id(x) not in taken]
        return batch

    def _voc_kick(self) -> None:
        if self.voc_busy or not self.voc_queue:
            return
        now = self.clock.now
        # the batcher's wait to fill: until the oldest ready chunk has waited max_wait
        sessions = len({x[1].sid for x in self.voc_queue})
        fill_by = min(x[3] for x in self.voc_queue) + self.c.vocoder_max_wait_s
        if sessions < self.c.vocoder_max_rows and fill_by > now:
            if fill_by < self._voc_wake:
                self._voc_wake = fill_by
                self.clock.at(fill_by, self._voc_wakeup, fill_by)
            return
        batch = self._voc_take(now)
        self.voc_busy = True
        t = self.c.vocoder_cost.batch_s([vocoder_window(x[2]) for x in batch])
        self.voc_batches.append({"t": round(now, 4), "rows": len(batch), "s": round(t, 4)})
        for _, s, chunk, _ in batch:
            s.stages[chunk.seq].append(now)
        if self.flow.running is not None:
            self.flow.debt += self.c.gpu_share * t
        self.clock.at(now + t, self._voc_done, batch, len(batch))

    def _voc_wakeup(self, t: float) -> None:
        if self._voc_wake == t:
            self._voc_wake = math.inf
        self._voc_kick()

    def _voc_done(self, batch, rows: int) -> None:
        self.voc_busy = False
        now = self.clock.now
        for _, s, chunk, _ in batch:
            s.stages[chunk.seq] += [now, rows]
            self.clock.at(now + self.c.wire_s, self._audio_back, s, chunk)
        self._voc_kick()

    def _audio_back(self, s: _Stream, chunk) -> None:
        t = self._gateway_cpu(s, self.c.gateway_chunk_s)
        if chunk.seq == 0 and not s.ended:
            # pipeline.py `_hold_first`: a wait, not CPU; the stream's later chunks queue behind
            t = max(t, s.ready[0] + self.c.start_buffer_s)
        s.out_free_at = max(t, s.out_free_at)
        self.clock.at(s.out_free_at, self._deliver, s, chunk)

    def _deliver(self, s: _Stream, chunk) -> None:
        end = TOKEN_MEL_RATIO * (chunk.token_offset + chunk.num_emit_tokens)
        upto = end if chunk.finalize else max(0, end - VOCODER_HOLDBACK_FRAMES)
        frames = upto - s.delivered_frames
        rec = s.rec
        now = self.clock.now
        rec.seqs.append(chunk.seq)
        rec.offsets.append(s.delivered_frames * SAMPLES_PER_FRAME)
        rec.num_samples.append(frames * SAMPLES_PER_FRAME)
        rec.arrivals.append(now + self.c.wire_s)
        f_in, f_start, f_done, f_rows, v_in, v_start, v_done, v_rows = s.stages.pop(chunk.seq)
        ms = 1e3
        rec.timings.append(
            (
                (f_start - f_in) * ms,
                (f_done - f_start) * ms,
                f_rows,
                (v_start - v_in) * ms,
                (v_done - v_start) * ms,
                v_rows,
                (now - s.ready[chunk.seq]) * ms,  # the gateway's clock: tokens in -> sent
            )
        )
        s.delivered_frames = upto
        if s.playback:
            if chunk.seq > 0 and s.admitted is not None:  # pipeline.py `run`: admission feedback
                needed = s.playback.needed_at(chunk, s.ready[chunk.seq], project=True)
                self.admission[s.gateway].observe(now - needed)
            s.playback.sent(frames * SAMPLES_PER_FRAME / SAMPLE_RATE)
        if chunk.finalize:
            rec.final_seen = True
            rec.closed = now + self.c.wire_s
            if s.admitted is not None:
                _now(self.admission[s.gateway].release(s.admitted))
                s.admitted = None

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
    config: SimConfig,
    rate: float,
    duration: float = 10.0,
    pace: float = 0.0,
    seed: int = 0,
    mix: str = "uniform",
) -> dict:
    """Poisson arrivals; `mix` "mixed": bench/workload.py's mixed streams (`pace` unused)."""
    sim = Simulation(config)
    workload = WorkloadConfig(seed=seed, mix=mix)
    for i, t in enumerate(poisson_arrivals(seed, rate, duration)):
        shape = workload.shape(i) if mix == "mixed" else None
        sim.add_stream(f"p{i}", float(t), pace, shape)
    recs = sim.run()
    return _figures(sim, recs, duration)


def overload(
    config: SimConfig, rate: float, duration: float = 20.0, pace: float = 0.0, seed: int = 0
) -> dict:
    """Poisson arrivals at `rate` through the gateways' admission: how many it refused, and
    how the admitted streams fared (on time: no stack-added stall, bench/capacity.py)."""
    sim = Simulation(config)
    for i, t in enumerate(poisson_arrivals(seed, rate, duration)):
        sim.add_stream(f"o{i}", float(t), pace)
    recs = sim.run()
    m = summarize(recs, duration)
    admitted = m["num_ok"]
    on_time = admitted - m["underruns"]["stack_streams"]
    return {
        "rate": rate,
        "streams": m["num_streams"],
        "admitted": admitted,
        "refused": sim.refused,
        "on_time": on_time,
        "on_time_share": round(on_time / admitted, 3) if admitted else None,
        "first_chunk_p50_ms": round(m["first_chunk_ms"]["p50"], 1) if admitted else None,
        "first_chunk_p95_ms": round(m["first_chunk_ms"]["p95"], 1) if admitted else None,
        "factor": [round(a.factor, 3) for a in sim.admission],
    }


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(float(x), digits)


def _figures(sim: Simulation, recs: list[StreamRecord], window: float) -> dict:
    m = summarize(recs, window)
    u = m["underruns"]
    st = m["first_chunk_stages"] or {}
    fc, excess = m["first_chunk_ms"] or {}, u["excess_buffer_ms"] or {}
    keys = ("flow_queue", "flow_compute", "vocoder_queue", "vocoder_compute", "gateway")
    # None where nothing was measured (a window with no arrival, a run with no batch)
    return {
        "streams": m["num_streams"],
        "ok": m["num_ok"],
        "first_chunk_p50_ms": _round(fc.get("p50"), 1),
        "first_chunk_p95_ms": _round(fc.get("p95"), 1),
        "stack_stalled": u["stack_streams"],
        "xrt": round(m["xrt"] or 0.0, 1),
        "excess_p99_ms": _round(excess.get("p99"), 1),
        "first_chunk_stages_ms": {k: round(st.get(f"{k}_ms", 0.0), 1) for k in keys},
        "batches": len(sim.batches),
        "preemptions": sim.flow.core.num_preemptions,
        "mean_rows": _round(np.mean([b["rows"] for b in sim.batches]) if sim.batches else None, 2),
        # waiting calls the batches were formed without, by the limit that kept them out
        "left_out": dict(sum((Counter(b["left_out"]) for b in sim.batches), Counter())),
        "graph_captures": dict(sim.captures),
    }


# The DiT sequences (num_seq_frames, what the graphs pad) of a 10 s utterance's calls 0/1/2/final
# as bench/profile_prefix.py runs them; its output names them by their tokens' frames,
# 206/306/506/656 with the 3 lookahead tokens.
PROFILE_FRAMES = (200, 300, 500, 650)
PROFILE_RUN = Path(__file__).parent.parent / "docs/bench/capacity-2026-12-03e/profile_prefix.txt"


def profiled_ms(path: Path = PROFILE_RUN) -> dict[int, tuple[tuple[float, ...], ...]]:
    """bench/profile_prefix.py's output: rows -> ms per batch of calls 0/1/2/final, graphed,
    eager, eager with the prefix cache (the order `profile_model` gives them in)."""
    kinds = {"graphed": 0, "no cache": 1, "cache": 2}
    found: dict[int, list] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"B=\s*(\d+)\s+(graphed|no cache|cache)\s+(.*)$", line)
        if m:
            row = found.setdefault(int(m[1]), [None] * 3)
            row[kinds[m[2]]] = tuple(float(x) for x in m[3].split("/"))
    return {rows: tuple(r) for rows, r in found.items()}


def profile_model(fit: FlowCostFit, rows: int) -> tuple[tuple[float, ...], ...]:
    """`FlowCostFit`'s ms for the profiled batches (`profiled_ms`): graphed, eager, eager with the prefix
    cache (each call reads the blocks the one before stored, up to its first returned frame,
    and stores its complete blocks; the final call recomputes everything)."""
    graphed = tuple(1e3 * fit.graphed_s(rows, f) for f in PROFILE_FRAMES)
    eager = tuple(1e3 * fit.eager_s(rows, f) for f in PROFILE_FRAMES)
    cached, prev = [], 0
    for i, f in enumerate(PROFILE_FRAMES):
        final = i + 1 == len(PROFILE_FRAMES)
        out_start = PROFILE_FRAMES[i - 1] if i else 0  # the previous call's last frame
        prefix = 0 if final else min(prev, out_start // BLOCK_FRAMES * BLOCK_FRAMES)
        end = 0 if final else f // BLOCK_FRAMES * BLOCK_FRAMES
        stored = rows * max(0, end - prefix)
        cached.append(1e3 * fit.eager_s(rows, f, f - prefix, stored))
        prev = max(prev, end)
    return graphed, eager, tuple(cached)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64, help="closed-loop streams (0: none)")
    ap.add_argument(
        "--rates", default="3,5,7,9,10,11", help="Poisson rates (streams/s), comma list"
    )
    ap.add_argument("--paces", default="0,50", help="token paces (tokens/s, 0: all at once)")
    ap.add_argument("--duration", type=float, default=10.0, help="Poisson window (s)")
    ap.add_argument("--seed", type=int, default=0, help="Poisson arrivals' seed")
    ap.add_argument(
        "--mix",
        choices=("uniform", "mixed"),
        default="uniform",
        help="Poisson streams: uniform (the prompt, length and --paces of the config) or "
        "bench/workload.py's mixed workload (each its own voice, length and pace; --paces "
        "unused)",
    )
    ap.add_argument("--no-deadlines", action="store_true", help="gateway sends no deadlines")
    ap.add_argument("--batches", action="store_true", help="print the closed loop's batches")
    ap.add_argument(
        "--block-calls",
        action="store_true",
        help="the gateway's --block-calls: each 25-token block a flow call of its own",
    )
    ap.add_argument(
        "--schedule",
        choices=("upstream", "blocks"),
        default="upstream",
        help="the gateway's --schedule: the streams' chunks (%(default)s)",
    )
    ap.add_argument(
        "--final-attention",
        choices=("full", "chunked"),
        default="full",
        help="the gateway's --final-attention: the last call full attention (exact, "
        "recomputes the utterance) or block-causal over the cached blocks (%(default)s)",
    )
    base = SimConfig()
    knobs = ap.add_argument_group("the services' flags (defaults: what the bench runs)")
    for flag, default, kind, what in [
        ("--max-batch-frames", base.policy.max_batch_frames, int, "flow: rows x padded frames"),
        ("--max-wait-ms", base.policy.max_wait_ms, float, "flow: wait for a batch to fill"),
        ("--start-buffer-ms", base.start_buffer_s * 1e3, float, "gateway: first audio held"),
        ("--urgent-slack-ms", base.vocoder_urgent_slack_s * 1e3, float, "vocoder, 0: off"),
        ("--urgent-max-frames", base.vocoder_urgent_max_frames, int, "vocoder urgent batch"),
        ("--gateways", base.gateways, int, "gateway processes, streams round robin"),
        ("--graph-max-frames", base.graph_max_frames, int, "flow: graphs up to rows x frames"),
        ("--graph-capture-ms", base.graph_capture_s * 1e3, float, "flow: a new graph shape"),
        ("--warmup-max-prefix", base.warmup_max_prefix, int, "flow: prefix graphs warmed up"),
    ]:
        knobs.add_argument(flag, type=kind, default=default, help=f"{what} (%(default)s)")
    adm = ap.add_argument_group(
        "admission (the gateway's --admission-...; each gateway process admits its own streams)"
    )
    adm.add_argument(
        "--overload",
        type=float,
        default=0.0,
        metavar="RATE",
        help="run Poisson arrivals at RATE streams/s (tokens at once) for --overload-seconds "
        "through the gateways' admission control instead of the runs above, and stop",
    )
    adm.add_argument("--overload-seconds", type=float, default=20.0, help="(%(default)s)")
    adm.add_argument(
        "--admission-headroom",
        type=float,
        default=AdmissionConfig().headroom,
        help="share of the flow's reported capacity admission plans with (%(default)s)",
    )
    a = ap.parse_args(argv)
    if a.streams < 0:
        ap.error(f"--streams: want >= 0, got {a.streams}")
    policy = replace(base.policy, max_batch_frames=a.max_batch_frames, max_wait_ms=a.max_wait_ms)
    cfg = replace(
        base,
        policy=policy,
        deadlines=None if a.no_deadlines else DeadlineConfig(),
        start_buffer_s=a.start_buffer_ms / 1e3,
        vocoder_urgent_slack_s=a.urgent_slack_ms / 1e3,
        vocoder_urgent_max_frames=a.urgent_max_frames,
        gateways=a.gateways,
        graph_max_frames=a.graph_max_frames,
        block_calls=a.block_calls,
        schedule=ScheduleConfig.named(a.schedule, a.final_attention),
        graph_capture_s=a.graph_capture_ms / 1e3,
        warmup_max_prefix=a.warmup_max_prefix,
    )
    if a.overload > 0:
        cfg = replace(cfg, admission=AdmissionConfig(enabled=True, headroom=a.admission_headroom))
        print(json.dumps(overload(cfg, a.overload, a.overload_seconds, 0.0, a.seed)))
        return
    if a.streams:
        print("closed", a.streams, json.dumps(closed_loop(cfg, a.streams)))
    if a.batches:
        sim = Simulation(cfg)
        for i in range(a.streams):
            sim.add_stream(f"c{i}", i * 0.0004, 0.0)
        sim.run()
        for b in sim.batches:
            print(b)
    if a.mix == "mixed":
        for rate in (float(r) for r in a.rates.split(",")):
            f = poisson(cfg, rate, a.duration, 0.0, a.seed, "mixed")
            print(f"mixed rate {rate:g}", json.dumps(f))
        return
    for pace in (float(p) for p in a.paces.split(",")):
        for rate in (float(r) for r in a.rates.split(",")):
            f = poisson(cfg, rate, a.duration, pace, a.seed)
            print(f"pace {pace:g} rate {rate:g}", json.dumps(f))


__all__ = [
    "FlowCostFit",
    "SimConfig",
    "Simulation",
    "VocoderCostFit",
    "closed_loop",
    "overload",
    "poisson",
    "replace",
]
