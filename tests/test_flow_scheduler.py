"""The flow batching policy on its own: no tensors, no model, hand-made calls."""

from __future__ import annotations

import math
import threading

import pytest

from flow_service.runner import UrgentRequest
from flow_service.scheduler import BatchPolicy, CallStatus, PendingCall, Plan, Scheduler
from token2wav.errors import ResourceExhausted


def call(frames: int, first: bool = False, deadline: float = math.inf, arrival: float = 0.0):
    return PendingCall(frames, frames, first, deadline, payload=None, arrival=arrival)


def test_first_chunks_anchor_and_lead_the_batch():
    policy = BatchPolicy(max_batch_size=3, min_padding_efficiency=0.0, first_chunks_apart=False)
    s = Scheduler(policy)
    old = [call(300, arrival=i) for i in range(3)]
    new = call(200, first=True, arrival=10)
    for c in [*old, new]:
        s.add(c)
    plan = s.schedule()
    assert plan.calls == [new, old[0], old[1]]  # then arrival order
    assert plan.padded_len == 300 and plan.num_padded_frames == 900
    assert [c.status for c in plan.calls] == [CallStatus.RUNNING] * 3
    assert s.waiting == [old[2]]


def test_frame_cap_and_padding_efficiency_keep_calls_out():
    s = Scheduler(BatchPolicy(max_batch_size=8, max_batch_frames=1000, min_padding_efficiency=0.7))
    short, long_, mid = call(200, arrival=0), call(600, arrival=1), call(240, arrival=2)
    for c in (short, long_, mid):
        s.add(c)
    plan = s.schedule()
    # 200 + 600 pads to 2 x 600: efficiency 0.67 < 0.7, so the long call waits; 240 joins.
    assert plan.calls == [short, mid]
    assert plan.padding_efficiency == pytest.approx(440 / 480)
    # what kept each waiting call out (Plan.left_out): 2 x 600 is past the frame cap too,
    # which is named first
    assert plan.left_out == {"frames": 1}
    assert s.schedule().calls == [long_]
    s2 = Scheduler(BatchPolicy(max_batch_size=8, max_batch_frames=1000, min_padding_efficiency=0))
    for c in (call(400), call(400), call(400)):
        s2.add(c)
    plan = s2.schedule()
    assert len(plan.calls) == 2  # a third row would make 1200 padded frames
    assert plan.left_out == {"frames": 1}
    s3 = Scheduler(BatchPolicy(max_batch_size=8, min_padding_efficiency=0.7))
    for c in (call(200), call(600)):
        s3.add(c)
    assert s3.schedule().left_out == {"padding": 1}
    s4 = Scheduler(BatchPolicy(max_batch_size=2, min_padding_efficiency=0))
    for c in (call(400), call(400), call(400), call(400)):
        s4.add(c)
    assert s4.schedule().left_out == {"rows": 2}
    assert s4.schedule().left_out == {}


def test_padding_counts_the_frames_computed_past_the_prefix_cache():
    """A final call computes its whole 1000 frames; a later chunk of another stream, as long,
    reads 900 of them from the cache. Together their sequences pad perfectly, but the batch
    would compute 1000 frames for both rows (efficiency 1100 / 2000 < 0.7): the final waits,
    and a chunk that computes about as much as the first joins it."""
    s = Scheduler(BatchPolicy(max_batch_size=8, min_padding_efficiency=0.7))
    chunk = PendingCall(1000, 100, False, math.inf, None, arrival=0, num_cached_frames=900)
    final = PendingCall(1000, 200, False, math.inf, None, arrival=1, final=True)
    other = PendingCall(800, 100, False, math.inf, None, arrival=2, num_cached_frames=700)
    for c in (chunk, final, other):
        s.add(c)
    assert chunk.num_query_frames == 100 and final.num_query_frames == 1000
    assert s.schedule().calls == [chunk, other]  # sequences 1800 / 2000, computed 200 / 200
    assert s.schedule().calls == [final]
    # with nothing cached the same three batch as before: the rule is the sequences' alone
    s2 = Scheduler(BatchPolicy(max_batch_size=8, min_padding_efficiency=0.7))
    plain = [
        PendingCall(t, 100, False, math.inf, None, arrival=i)
        for i, t in enumerate((1000, 1000, 800))
    ]
    for c in plain:
        s2.add(c)
    assert s2.schedule().calls == plain


def test_first_chunks_apart_keeps_later_chunks_out_of_a_first_chunk_batch():
    s = Scheduler(BatchPolicy(min_padding_efficiency=0.0))
    later = [call(300, arrival=i) for i in range(3)]
    firsts = [call(200, first=True, arrival=5 + i) for i in range(2)]
    for c in [*later, *firsts]:
        s.add(c)
    plan = s.schedule()
    assert plan.calls == firsts
    assert plan.left_out == {"first_chunks": 3}
    assert s.schedule().calls == later  # later chunks still batch together


def test_first_chunks_only_leaves_later_chunks_queued():
    s = Scheduler(BatchPolicy())
    later = [call(600, arrival=i) for i in range(3)]
    firsts = [call(200, first=True, arrival=5 + i) for i in range(2)]
    for c in [*later, *firsts]:
        s.add(c)
    assert s.num_first_chunks_waiting == 2
    plan = s.schedule(first_chunks_only=True)
    assert plan.calls == firsts
    assert s.num_first_chunks_waiting == 0
    assert s.schedule(first_chunks_only=True) is None
    assert s.waiting == later


def test_expired_and_cancelled_calls_leave_the_queue():
    s = Scheduler(BatchPolicy())
    keep, expired, cancelled = call(200, deadline=10.0), call(200, deadline=1.0), call(200)
    for c in (keep, expired, cancelled):
        s.add(c)
    cancelled.status = CallStatus.CANCELLED
    assert s.drop_finished(now=5.0) == [expired]
    assert expired.status == CallStatus.EXPIRED
    assert s.waiting == [keep]


def test_wait_only_while_busy_and_bounded_queue():
    s = Scheduler(BatchPolicy(max_batch_size=2, max_wait_ms=10, max_queue=2))
    assert s.ready_at(now=100.0) == math.inf
    s.add(call(200, arrival=100.0))
    assert s.ready_at(now=100.0) == 100.0  # idle card: at once
    s.mark_busy_until(100.0)
    assert s.ready_at(now=100.001) == pytest.approx(100.010)  # busy: let the batch fill
    s.add(call(200, arrival=100.002))
    assert s.ready_at(now=100.003) == 100.003  # full batch: at once
    with pytest.raises(ResourceExhausted):
        s.add(call(200))
    assert len(s) == 2


def test_urgent_request_is_never_answered_after_the_runner_gave_up():
    ask = UrgentRequest()
    assert ask.wait(timeout=0.01) is None  # the loop did not answer in time
    assert not ask.open()  # so the loop takes nothing out of the queue afterwards

    ask = UrgentRequest()
    plan = Plan([call(200, first=True)], 200)
    answered = threading.Thread(target=lambda: ask.open() and ask.deliver(plan))
    answered.start()
    assert ask.wait(timeout=5.0) is plan
    answered.join()


def test_urgent_request_answered_while_the_runner_times_out_is_still_received():
    """The loop has taken calls out of the queue (lock held) when the runner's wait times out:
    the runner must still get that plan, or those calls would never finish."""

    class TimesOut(threading.Event):
        """The runner's wait for an answer times out at once, and says so."""

        def __init__(self):
            super().__init__()
            self.timed_out = threading.Event()

        def wait(self, timeout=None):
            self.timed_out.set()
            return False

    ask = UrgentRequest()
    ask._answered = TimesOut()
    plan = Plan([call(200, first=True)], 200)
    assert ask.open()  # this thread is the loop: it holds the lock, taking calls
    got = []
    runner = threading.Thread(target=lambda: got.append(ask.wait(timeout=5.0)))
    runner.start()
    assert ask._answered.timed_out.wait(5)  # the runner gave up waiting for the answer...
    ask.deliver(plan)  # ...while the loop, lock held, was about to deliver it
    runner.join(5)
    assert got == [plan]
