"""Deadline-driven scheduling and admission (issue 16): the flow scheduler's slack order, batch
formation and preemption with a fake cost model and explicit clocks; the vocoder's least-slack
steps; the gateway's playback deadlines and admission estimate; and on loopback, a low-slack
call overtaking a queue of high-slack work while a call without a deadline (an old client)
still runs."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time

import grpc
import numpy as np
import pytest
import torch

# the gateway tests' loopback stack and helpers (tests/ is on sys.path under pytest)
from _stack import start_flow
from test_gateway import (
    END,
    _call,
    cfg_msg,
    check_exactly_once,
    run_stream,
    start_stack,
    stream_inputs,
    tok,
)

from flow_service.costmodel import CostModel, CostPrior
from flow_service.model import load_flow
from flow_service.scheduler import BatchPolicy, PendingCall, Scheduler
from gateway.admission import (
    AdmissionConfig,
    AdmissionController,
    CapacityBoard,
    edf_lateness,
)
from gateway.client import AsyncClient
from gateway.deadlines import (
    VOCODER_HOLDBACK_FRAMES,
    DeadlineConfig,
    PlaybackClock,
    audio_position_s,
    slack_ms,
)
from gateway.schedule import FlowCall
from token2wav.errors import ResourceExhausted
from token2wav.tensors import encode, make_voice
from token2wav.v1 import flow_pb2, flow_pb2_grpc
from vocoder_service.chunks import MelChunk
from vocoder_service.config import SessionConfig
from vocoder_service.manager import SessionManager
from vocoder_service.model import load_hift

torch.set_num_threads(1)


class FakeCost:
    """Batch seconds = per_frame x rows x padded length (no overhead, no learning)."""

    def __init__(self, per_frame: float = 1e-4):
        self.per_frame = per_frame

    def estimate(self, rows: int, padded_len: int) -> float:
        return self.per_frame * rows * padded_len

    def step_s(self, rows: int, padded_len: int) -> float:
        return self.estimate(rows, padded_len) / 10


def call(frames, due=math.inf, first=False, arrival=0.0):
    return PendingCall(frames, frames, first, math.inf, payload=None, arrival=arrival, due=due)


def sched(**kw) -> Scheduler:
    kw.setdefault("min_padding_efficiency", 0.0)
    return Scheduler(BatchPolicy(**kw), FakeCost())


# -- flow scheduler ---------------------------------------------------------------------------


def test_least_slack_anchors_not_first_chunk_or_arrival():
    s = sched(max_batch_size=1)
    # slack = due - now - 1e-4 * T: long has 1.0 - 0.06, short 0.9 - 0.02, first chunk 5 - 0.02
    long_ = call(600, due=1.0, arrival=0)
    short = call(200, due=0.9, arrival=1)
    first = call(200, due=5.0, first=True, arrival=2)
    for c in (first, long_, short):
        s.add(c)
    order = [s.schedule(now=0.0).calls[0] for _ in range(3)]
    assert order == [short, long_, first]  # 0.88, 0.94, 4.98


def test_calls_without_deadline_come_after_and_keep_todays_order():
    s = sched(max_batch_size=1)
    later = call(300, arrival=0)
    first = call(300, first=True, arrival=1)
    dated = call(300, due=100.0, arrival=2)
    for c in (later, first, dated):
        s.add(c)
    assert [s.schedule(now=0.0).calls[0] for _ in range(3)] == [dated, first, later]
    # without any deadline in the queue: exactly the old priority (first chunks first)
    s2 = sched(max_batch_size=1)
    a, b = call(300, arrival=0), call(300, first=True, arrival=1)
    s2.add(a), s2.add(b)
    assert s2.schedule(now=0.0).calls == [b]


def test_join_that_would_make_a_row_late_is_refused():
    s = sched(max_batch_size=8)
    tight = call(400, due=0.05)  # alone 0.04 s: on time; with one more row 0.08 s: late
    loose = [call(400, due=10.0, arrival=i) for i in range(3)]
    for c in (tight, *loose):
        s.add(c)
    plan = s.schedule(now=0.0)
    assert plan.calls == [tight]
    assert plan.left_out == {"deadline": 3}  # each refused by the on-time limit (Plan.left_out)
    assert s.schedule(now=0.04).calls == loose  # the rest batch together afterwards


def test_left_out_row_limits_how_long_the_batch_may_grow():
    def plan_rows(with_short: bool) -> int:
        s = sched(max_batch_size=64, min_padding_efficiency=0.7)
        s.add(call(600, due=1.0))  # anchor: slack 0.94; 16 rows of 600 end at 0.96
        for i in range(20):
            s.add(call(600, due=50.0, arrival=1 + i))
        if with_short:
            # padding keeps it out of a 600-frame batch; it must start by 0.97 - 0.02 = 0.95
            s.add(call(200, due=0.97, arrival=0.5))
        return len(s.schedule(now=0.0).calls)

    assert plan_rows(False) == 16
    assert plan_rows(True) == 15  # 15 x 0.06 = 0.90 <= 0.95: the short row still makes it


def test_late_row_does_not_block_growth():
    s = sched(max_batch_size=4)
    late = call(400, due=0.01)  # cannot make it even alone
    rest = [call(400, due=10.0, arrival=i) for i in range(3)]
    for c in (late, *rest):
        s.add(c)
    assert s.schedule(now=0.0).calls == [late, *rest]


def test_preemption_takes_work_whose_slack_is_below_one_step():
    s = sched()
    urgent = call(200, due=0.1)  # slack 0.08
    relaxed = call(200, due=5.0)  # slack 4.98
    old_first = call(200, first=True)  # no deadline: does not preempt work that has one
    for c in (urgent, relaxed, old_first):
        s.add(c)
    assert s.is_urgent(urgent, 0.0, 0.1) and not s.is_urgent(relaxed, 0.0, 0.1)
    assert s.latest_start() == pytest.approx(0.08)
    assert s.num_first_chunks_waiting == 0
    assert s.schedule(now=0.0, urgent_slack_s=0.1).calls == [urgent]
    assert set(s.waiting) == {relaxed, old_first}
    assert s.schedule(now=0.0, urgent_slack_s=0.1) is None  # nothing else is urgent
    assert s.schedule(now=4.9, urgent_slack_s=0.1).calls == [relaxed]  # its slack ran out
    # with no deadline left in the queue, first chunks preempt as before
    assert s.num_first_chunks_waiting == 1
    assert s.schedule(now=5.0, urgent_slack_s=0.1).calls == [old_first]


def test_ready_at_starts_a_batch_early_for_a_tight_call():
    s = sched(max_wait_ms=50.0)
    s.mark_busy_until(0.0)  # busy: normally wait for the batch to fill
    s.add(call(200, due=0.03, arrival=0.0))  # latest start 0.01 < arrival + 0.05
    assert s.ready_at(0.0) == pytest.approx(0.01)


def test_cost_model_learns_buckets_and_capacity():
    m = CostModel(10, CostPrior(overhead_s=0.01, frames_per_s=1000.0))
    assert m.capacity_frames_per_s == 0.0
    assert m.estimate(2, 100) == pytest.approx(0.01 + 0.2)
    for _ in range(50):
        m.observe(64, 600, 2.0)  # 38400 frames in 2 s
    assert m.estimate(64, 600) == pytest.approx(2.0)
    assert m.step_s(64, 600) == pytest.approx(0.2)
    # same bucket (64 rows, 600 frames): scaled along the line, 0.01 + 36000 / 1000 = 36.01
    assert m.estimate(60, 600) == pytest.approx(2.0 * 36.01 / 38.41)
    assert 15000 < m.capacity_frames_per_s < 20000  # ~38400 / (2 - 0.01)


# -- vocoder ----------------------------------------------------------------------------------


async def test_vocoder_steps_serve_least_slack_first():
    mgr = SessionManager(SessionConfig(), lambda: object(), lambda b: object(), clock=lambda: 0.0)
    mel = np.zeros((80, 4), np.float32)
    chunks = {}
    for rid, due in (("a", math.inf), ("b", 5.0), ("c", 1.0), ("d", math.inf)):
        chunks[rid] = MelChunk(rid, 0, mel, False, due=due)
        mgr.submit(chunks[rid])
    assert [c.request_id for c in mgr.take_ready(3)] == ["c", "b", "a"]
    mgr2 = SessionManager(SessionConfig(), lambda: object(), lambda b: object())
    for rid in ("x", "y"):
        mgr2.submit(MelChunk(rid, 0, mel, False))
    assert [c.request_id for c in mgr2.take_ready(2)] == ["x", "y"]  # no deadlines: FIFO


# -- gateway: playback deadlines --------------------------------------------------------------


def test_vocoder_holdback_constant_matches_the_vocoder():
    from vocoder_service.model import HOLDBACK_FRAMES

    assert VOCODER_HOLDBACK_FRAMES == HOLDBACK_FRAMES


def test_playback_deadlines_follow_the_player():
    now = [10.0]
    pc = PlaybackClock(DeadlineConfig(0.15, 0.05), clock=lambda: now[0])
    c0 = FlowCall(0, 28, 0, False, True)
    c1 = FlowCall(1, 78, 25, False, True)  # audio before it: (50 - 8) frames = 0.84 s
    assert audio_position_s(c1) == pytest.approx(0.84)
    assert pc.due(c0, ready_at=10.0) == pytest.approx(10.10)
    # before playback starts: counted from the first chunk's tokens (the earliest start)
    assert pc.due(c1, ready_at=10.0) == pytest.approx(10.0 + 0.84 - 0.05)
    now[0] = 10.2  # first audio (0.84 s) goes out 50 ms after its target
    pc.sent(0.84)
    assert pc.due(c1, ready_at=10.0) == pytest.approx(10.2 + 0.84 - 0.05)
    # tokens that come late: needed as fast as the first chunk came (0.2 s after its tokens)
    assert pc.first_latency == pytest.approx(0.2)
    assert pc.due(c1, ready_at=12.0) == pytest.approx(12.0 + 0.2 - 0.05)
    now[0] = 13.0  # the player ran dry at 11.04; the next audio restarts it
    pc.sent(1.0)
    c2 = FlowCall(2, 178, 75, False, True)  # position (150 - 8) / 50 = 2.84 s
    assert pc.due(c2, ready_at=12.0) == pytest.approx(14.0 + (2.84 - 1.84) - 0.05)
    assert slack_ms(10.5, 10.25) == 250 and slack_ms(10.0, 10.25) == -250


# -- gateway: admission -----------------------------------------------------------------------


class FakeStream:
    def __init__(self, items):
        self.items = items

    def remaining_work(self, now, expected_tokens):
        return [(now + d, f) for d, f in self.items]


def controller(capacity: float, **kw) -> AdmissionController:
    board = CapacityBoard(clock=lambda: 0.0)
    board.report("flow-a", capacity / 2)
    board.report("flow-b", capacity / 2)
    cfg = AdmissionConfig(enabled=True, headroom=1.0, **kw)
    return AdmissionController(cfg, board, clock=lambda: 0.0)


def test_edf_lateness_per_item_at_capacity():
    # 1000 frames/s: 100 frames due 0.05 finish 0.1 (0.05 late); the next 100 finish 0.2
    assert edf_lateness([(1.0, 100), (0.05, 100)], 1000.0, 0.0) == pytest.approx([-0.8, 0.05])
    assert edf_lateness([(1.0, 100), (0.5, 100)], 1000.0, 0.0) == pytest.approx([-0.8, -0.4])
    # ties: the item listed first is served first
    assert edf_lateness([(0.1, 100), (0.1, 100)], 1000.0, 0.0) == pytest.approx([0.0, 0.1])


async def test_admission_admits_when_on_time_and_refuses_when_late():
    ctl = controller(10000.0, tolerance_s=0.0)
    work = [(0.09, 200), (1.0, 300), (3.0, 600)]  # a first chunk due in 90 ms, then more
    new = FakeStream(work)
    for _ in range(3):
        await ctl.admit(FakeStream(work))
    ok, _ = ctl.check(new)
    assert ok  # 4 x 200 frames by 0.09 s: done at 0.08 s at 10000 frames/s
    await ctl.admit(new)
    with pytest.raises(ResourceExhausted, match="late by 10 ms"):
        await ctl.admit(FakeStream(work))  # 5 x 200 frames: done at 0.10 s
    assert len(ctl.streams) == 4
    await ctl.release(new)
    assert ctl.check(FakeStream(work))[0]


async def test_admission_does_not_blame_the_new_stream_for_existing_lateness():
    ctl = controller(1000.0)
    ctl.streams.add(FakeStream([(0.0, 500)]))  # already 0.5 s late
    assert ctl.check(FakeStream([(100.0, 100)]))[0]  # lands after it: lateness unchanged
    assert not ctl.check(FakeStream([(0.0, 100)]))[0]  # jumps ahead: makes it later


def test_admission_counts_work_in_the_flows_unit_dit_sequence_frames():
    """A chunk's work for admission is the DiT sequence length the flow's cost model and its
    reported capacity count (FlowRequest.num_seq_frames): lookahead tokens are context."""
    from test_flow_model import make_voice as flow_voice

    from flow_service.model import FlowRequest
    from gateway.schedule import ChunkPlanner

    voice = flow_voice(3, 75)
    tokens = torch.zeros(250, dtype=torch.long)
    planner = ChunkPlanner(75)
    frames = []
    while (c := planner.next_call(250, True)) is not None:
        req = FlowRequest(voice, tokens[: c.num_tokens], c.token_offset, c.finalize, c.streaming)
        assert c.num_seq_frames(75) == req.num_seq_frames
        frames.append(req.num_seq_frames)
    assert frames == [200, 300, 500, 650]


async def test_admission_refuses_a_newcomer_late_behind_a_late_stream():
    """Overload: one admitted chunk is already estimated 0.5 s late. A newcomer whose first
    chunk would queue behind it and be late itself is refused, although the worst lateness
    (the old stream's) stays the same; one that also pushes an on-time admitted chunk late is
    refused even when that stays under the worst."""
    ctl = controller(1000.0, tolerance_s=0.02)
    ctl.streams.add(FakeStream([(0.0, 500)]))  # finishes at 0.5: 0.5 s late
    ok, why = ctl.check(FakeStream([(0.15, 100)]))  # finishes at 0.6: 0.45 s late
    assert not ok and "late by 450 ms" in why
    assert ctl.check(FakeStream([(0.7, 100)]))[0]  # behind it but in time
    ctl.streams.add(FakeStream([(0.65, 100)]))  # on time now: finishes at 0.6
    ok, why = ctl.check(FakeStream([(0.64, 100)]))  # on time itself, pushes it to 0.7
    assert not ok and "late by 50 ms" in why


async def test_admission_fails_open_without_capacity_and_when_disabled():
    ctl = AdmissionController(AdmissionConfig(enabled=True), CapacityBoard())
    assert ctl.check(FakeStream([(0.0, 10**9)]))[0]
    off = controller(1.0)
    off.config = AdmissionConfig(enabled=False)
    assert off.check(FakeStream([(0.0, 10**9)]))[0]


async def test_late_chunks_cut_the_capacity_admission_plans_with_and_on_time_ones_restore_it():
    now = [0.0]
    board = CapacityBoard(clock=lambda: now[0])
    board.report("flow", 10000.0)
    cfg = AdmissionConfig(enabled=True, headroom=1.0, tolerance_s=0.02, feedback_recover=0.1)
    ctl = AdmissionController(cfg, board, clock=lambda: now[0])
    work = [(0.09, 200), (1.0, 300), (3.0, 600)]
    for _ in range(4):
        await ctl.admit(FakeStream(work))  # 4 x 200 frames by 0.09 s at 10000/s: on time
    ctl.observe(0.015)  # within the tolerance: no cut
    assert ctl.capacity() == pytest.approx(10000.0)
    ctl.observe(0.3)  # a chunk 300 ms late
    assert ctl.capacity() == pytest.approx(7000.0)
    ok, why = ctl.check(FakeStream(work))
    assert not ok and "7000 frames/s" in why  # 5 x 200 frames no longer fit by 0.09 s
    ctl.observe(0.5)  # the same burst, within the interval: no second cut
    assert ctl.factor == pytest.approx(0.7)
    now[0] = 1.0
    ctl.observe(0.5)
    assert ctl.factor == pytest.approx(0.49)
    for _ in range(3):
        ctl.observe(-0.2)  # on time: won back additively, never above 1
    assert ctl.factor == pytest.approx(0.79)
    for _ in range(10):
        ctl.observe(-0.2)
    assert ctl.factor == 1.0
    for i in range(30):  # sustained lateness stops at the floor
        now[0] = 2.0 + i
        ctl.observe(1.0)
    assert ctl.factor == pytest.approx(cfg.feedback_floor)
    off = AdmissionController(dataclasses.replace(cfg, enabled=False), board)  # learns nothing
    off.observe(1.0)
    assert off.factor == 1.0


async def test_bounded_wait_admits_once_a_stream_ends():
    ctl = controller(1000.0, max_wait_s=30.0)
    big = FakeStream([(0.5, 400)])
    await ctl.admit(big)
    waiter = asyncio.ensure_future(ctl.admit(FakeStream([(0.5, 400)])))  # 0.8 s > 0.5 s
    await asyncio.sleep(0)  # let it check once and wait
    assert not waiter.done()
    await ctl.release(big)
    await waiter  # admitted on the release's notification, no timer involved
    assert len(ctl.streams) == 1


# -- flow service on loopback -----------------------------------------------------------------


class GatedModel(torch.nn.Module):
    """The real model; the first batch holds until `gate` opens, so calls queue behind it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.decoder = inner.decoder  # the engine reads the solver steps from it
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.order: list[int] = []  # token count of each batch's first request

    def generate(self, chunks, **kw):
        self.order.append(int(chunks[0].tokens.shape[0]))
        self.entered.set()
        if not self.gate.wait(timeout=60):
            raise TimeoutError("test gate never opened")
        return self.inner.generate(chunks, **kw)


@pytest.fixture(scope="module")
def flow_model():
    return load_flow(None, preset="small")


@pytest.fixture(scope="module")
def models(flow_model):
    return flow_model, load_hift(None, preset="small")


async def test_low_slack_call_overtakes_high_slack_queue_and_old_clients_work(flow_model):
    gated = GatedModel(flow_model)
    server = await start_flow(gated, "--max-batch-size", "1", "--max-wait-ms", "0")
    engine = server.service.engine
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    queued = asyncio.Event()
    add = engine.scheduler.add

    def counting_add(c):
        add(c)
        if len(engine.scheduler.waiting) == 6:
            queued.set()

    engine.scheduler.add = counting_add
    try:
        stub = flow_pb2_grpc.FlowStub(channel)
        rng = np.random.default_rng(0)
        voice = make_voice(
            rng.integers(0, 6561, 10),
            rng.standard_normal((20, 80)).astype(np.float32),
            rng.standard_normal(192).astype(np.float32),
        )

        def req(n_tokens, **kw):
            return flow_pb2.GenerateRequest(
                request_id=f"n{n_tokens}",
                inline_voice=voice.to_proto(),
                tokens=encode(rng.integers(0, 6561, n_tokens).astype(np.int32)),
                token_offset=0,
                finalize=True,
                streaming=False,
                **kw,
            )

        plug = asyncio.ensure_future(stub.Generate(req(8, slack_ms=60000), timeout=60))
        await asyncio.to_thread(gated.entered.wait, 60)  # the runner holds the plug batch
        calls = [stub.Generate(req(10 + i, slack_ms=60000), timeout=60) for i in range(4)]
        calls.append(stub.Generate(req(20), timeout=60))  # an old client: no slack_ms
        calls.append(stub.Generate(req(30, slack_ms=0), timeout=60))  # due now
        pending = [asyncio.ensure_future(c) for c in calls]
        await asyncio.wait_for(queued.wait(), 60)
        gated.gate.set()
        responses = await asyncio.gather(plug, *pending)
        assert gated.order[1] == 30, gated.order  # the low-slack call ran first
        # then the high-slack calls (their order: slack, which the gRPC arrival order and
        # their lengths' cost decide), and the call without a deadline after all of them
        assert sorted(gated.order[2:6]) == [10, 11, 12, 13]
        assert gated.order[6] == 20  # the call without a deadline after those with one
        for n, resp in zip([8, 10, 11, 12, 13, 20, 30], responses):
            assert resp.mel.shape == [80, 2 * n]
        assert responses[-1].capacity_frames_per_s > 0  # learned from the batches before it
    finally:
        gated.gate.set()
        await channel.close()
        await server.drain()  # stops the engine too


# -- the gateway on loopback ------------------------------------------------------------------


async def test_gateway_admission_refuses_at_once_and_admits_with_room(models):
    from prometheus_client import REGISTRY

    voice, tokens = stream_inputs(5, 20, 40)
    refused = REGISTRY.get_sample_value("t2w_gateway_admission_refused_total") or 0.0
    stack = await start_stack(models, "--admission=true")
    try:  # 1 frame/s: even one stream would be late
        stack.gateway.service.servicer.admission.board.report("flow-a", 1.0)
        code, details = await _call(stack.target, [cfg_msg(voice), tok(tokens), END])
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "late by" in details
        assert REGISTRY.get_sample_value("t2w_gateway_admission_refused_total") == refused + 1
    finally:
        await stack.stop()
    # room enough: admitted, and each flow call carries its playback deadline
    stack = await start_stack(models, "--admission=true")
    stack.gateway.service.servicer.admission.board.report("flow-a", 1e9)
    slack = {}  # token_offset -> due - arrival at the flow engine, s
    submit = stack.engine.submit

    async def recording(request, deadline, due):
        slack[request.token_offset] = due - time.monotonic()
        return await submit(request, deadline, due)

    stack.engine.submit = recording
    lateness = []  # what the stream reports to admission's feedback, per chunk after seq 0
    stack.gateway.service.servicer.admission.observe = lateness.append
    try:
        async with AsyncClient(stack.target) as client:
            chunks = await run_stream(client, voice, tokens, seed=1)
        check_exactly_once(chunks, len(tokens))
    finally:
        await stack.stop()
    assert len(slack) == len(chunks)
    assert len(lateness) == len(chunks) - 1
    assert all(math.isfinite(v) for v in lateness)
    assert 0 < slack[0] <= 0.1  # first chunk: 150 ms target - 50 ms margin after its tokens
    assert all(math.isfinite(v) for v in slack.values())


class HoldFirstStep(torch.nn.Module):
    """The real model; the first batch holds after its first solver step until `gate` opens
    (then the engine looks at the queue between steps, as it does after every step)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.decoder = inner.decoder
        self.held = threading.Event()
        self.gate = threading.Event()
        self.batches: list[list[int]] = []  # token_offset of each request, per batch start

    def generate(self, chunks, between_steps=None, **kw):
        self.batches.append([c.token_offset for c in chunks])
        first = len(self.batches) == 1

        def step_done():
            if first and not self.held.is_set():
                self.held.set()
                if not self.gate.wait(timeout=60):
                    raise TimeoutError("test gate never opened")
            if between_steps is not None:
                between_steps()

        return self.inner.generate(chunks, between_steps=step_done, **kw)


async def test_engine_preempts_for_work_whose_slack_is_below_a_step(flow_model):
    from flow_service.engine import FlowEngine
    from flow_service.model import FlowRequest
    from flow_service.warmup import warmup_batch

    model = HoldFirstStep(flow_model)
    engine = FlowEngine(model, BatchPolicy(max_wait_ms=0.0), cuda_graphs=False)
    engine.start()
    try:
        base = warmup_batch(1, 200)[0]
        later = FlowRequest(base.voice, base.tokens, 10, finalize=False, streaming=True)
        relaxed = FlowRequest(base.voice, base.tokens, 20, finalize=False, streaming=True)
        now = time.monotonic
        running = asyncio.ensure_future(engine.submit(later, due=now() + 60))
        await asyncio.to_thread(model.held.wait, 60)  # inside the first batch, after a step
        urgent = asyncio.ensure_future(engine.submit(base, due=now()))  # due now: slack < 0
        waits = asyncio.ensure_future(engine.submit(relaxed, due=now() + 60))
        await asyncio.sleep(0)  # both submit() calls queue their call before they await
        assert len(engine.scheduler) == 2
        model.gate.set()
        results = await asyncio.gather(running, urgent, waits)
        # the due-now first chunk ran between the steps; the relaxed call after the batch
        assert model.batches == [[10], [0], [20]]
        assert engine.num_preemptions == 1
        assert [r.mel.shape[0] for r in results] == [80, 80, 80]
    finally:
        model.gate.set()
        await engine.stop()


async def test_engine_counts_and_logs_the_calls_a_batch_left_out(flow_model, caplog):
    """Plan.left_out reaches the service: t2w_flow_left_out_calls_total by reason, and the
    --log-batches line. Two calls wait for a free runner with room for one row: the first
    batch leaves the second out for its row limit."""
    from prometheus_client import REGISTRY

    from flow_service.engine import FlowEngine
    from flow_service.warmup import warmup_batch

    def left_out(reason):
        return REGISTRY.get_sample_value("t2w_flow_left_out_calls_total", {"reason": reason}) or 0

    model = HoldFirstStep(flow_model)
    policy = BatchPolicy(max_batch_size=1, max_wait_ms=0.0)
    engine = FlowEngine(model, policy, cuda_graphs=False, log_batches=True)
    engine.start()
    before = left_out("rows")
    try:
        a, b, c = warmup_batch(3, 200)
        first = asyncio.ensure_future(engine.submit(a))
        await asyncio.to_thread(model.held.wait, 60)  # the runner is busy with `a`
        rest = [asyncio.ensure_future(engine.submit(r)) for r in (b, c)]
        await asyncio.sleep(0)
        assert len(engine.scheduler) == 2
        with caplog.at_level("INFO", logger="flow_service.engine"):
            model.gate.set()
            await asyncio.gather(first, *rest)
    finally:
        model.gate.set()
        await engine.stop()
    assert left_out("rows") == before + 1  # b's batch left c out; c's left nothing
    assert sum("left out for rows 1" in r.getMessage() for r in caplog.records) == 1


async def test_start_buffer_holds_the_first_audio_of_an_open_stream_only(models):
    voice, tokens = stream_inputs(6, 20, 60)
    stack = await start_stack(models, "--start-buffer-ms=1500")
    try:
        async with AsyncClient(stack.target) as client:
            # input still open when the first audio is ready: held until 1.5 s after its tokens
            # (far longer than the small model takes, so only the hold can explain the wait)
            stream = client.stream(voice)
            sent = time.perf_counter()
            await stream.send(tokens)
            chunks = stream.__aiter__()
            first = await chunks.__anext__()
            await stream.end()
            rest = [c async for c in chunks]
            check_exactly_once([first, *rest], len(tokens))
            assert first.received_at - sent >= 1.5
            assert first.timing.gateway_ms >= 1500  # the hold is the gateway's time
    finally:
        await stack.stop()
    # input ended before the first audio: never held (a 60 s buffer would outlast the test)
    stack = await start_stack(models, "--start-buffer-ms=60000")
    try:
        async with AsyncClient(stack.target) as client:
            stream = client.stream(voice)
            await stream.send(tokens)
            await stream.end()

            async def collect():
                return [c async for c in stream]

            chunks = await asyncio.wait_for(collect(), 30)
        check_exactly_once(chunks, len(tokens))
    finally:
        await stack.stop()


async def test_a_stream_sets_its_own_start_buffer_both_ways(models):
    voice, tokens = stream_inputs(6, 20, 60)
    stack = await start_stack(models, "--start-buffer-ms=60000")  # would outlast the test
    try:
        async with AsyncClient(stack.target) as client:

            async def first_after_send(**kw):
                stream = client.stream(voice, **kw)
                sent = time.perf_counter()
                await stream.send(tokens)  # the input stays open until the first audio
                chunks = stream.__aiter__()
                first = await asyncio.wait_for(chunks.__anext__(), 30)
                await stream.end()
                check_exactly_once([first, *[c async for c in chunks]], len(tokens))
                return first.received_at - sent

            assert await first_after_send(start_buffer_ms=0) < 30  # not held at all
            assert await first_after_send(start_buffer_ms=1500) >= 1.5  # held, by its own
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await first_after_send(start_buffer_ms=2001)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "config.start_buffer_ms" in err.value.details()
    finally:
        await stack.stop()
