"""vocoder_service/batch_policy.py: the vocoder's batch rule, which the service and the
simulator both run."""

import math

from vocoder_service.batch_policy import batch_order, fits

INF = math.inf


def test_least_slack_first_fifo_among_equals_and_no_deadline_last():
    order, urgent = batch_order([INF, 5.0, 3.0, 5.0, INF], now=0.0, urgent_slack_s=0.0)
    assert order == [2, 1, 3, 0, 4] and not urgent


def test_urgent_chunks_alone_while_any_is_urgent():
    # slack below 1 s at now = 10: dues 10.5 and 9.0 (already late) are urgent
    order, urgent = batch_order([12.0, 10.5, INF, 9.0], now=10.0, urgent_slack_s=1.0)
    assert order == [3, 1] and urgent
    order, urgent = batch_order([12.0, INF], now=10.0, urgent_slack_s=1.0)
    assert order == [0, 1] and not urgent


def test_urgent_batches_stay_within_their_padded_frames():
    assert fits(0, 0, 500, urgent=True, urgent_max_frames=100)  # the first always goes
    assert fits(1, 100, 100, urgent=True, urgent_max_frames=200)
    assert not fits(1, 100, 101, urgent=True, urgent_max_frames=200)  # 2 x 101 padded frames
    assert not fits(2, 50, 50, urgent=True, urgent_max_frames=140)
    assert fits(9, 100, 100, urgent=True, urgent_max_frames=0)  # 0: no bound
    assert fits(9, 100, 500, urgent=False, urgent_max_frames=100)  # normal batches: rows only
