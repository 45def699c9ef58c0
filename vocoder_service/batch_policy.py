"""Which ready chunks the vocoder batches next: a pure function of their deadlines and sizes,
shared by `SessionManager.take_ready` (the service) and bench/simulate.py (the simulator), so the
simulator runs the service's rule rather than a copy of it."""

from __future__ import annotations

import math
from collections.abc import Sequence


def batch_order(dues: Sequence[float], now: float, urgent_slack_s: float) -> tuple[list[int], bool]:
    """(indices into `dues` in the order the batcher takes them, whether the batch is urgent).

    `dues` are the playback deadlines (monotonic s; inf: none) of each ready session's next
    chunk, in arrival order. Least slack first, FIFO among equals, so chunks without a deadline
    come last in arrival order. With `urgent_slack_s` > 0, a chunk whose slack (due - now) is
    below it is urgent: while any is, only urgent chunks are candidates (an urgent batch)."""
    order = sorted(range(len(dues)), key=lambda i: dues[i])  # stable
    urgent_before = now + urgent_slack_s if urgent_slack_s > 0 else -math.inf
    urgent = [i for i in order if dues[i] < urgent_before]  # a prefix of `order`
    return (urgent, True) if urgent else (order, False)


def fits(num_taken: int, longest: int, frames: int, urgent: bool, urgent_max_frames: int) -> bool:
    """Whether one more chunk of `frames` joins a batch of `num_taken` chunks whose longest has
    `longest` frames: always in a normal batch (the row limit is the caller's); in an urgent one
    while its padded frames (chunks x longest) stay within `urgent_max_frames` (0: no bound), the
    first chunk always."""
    if not (urgent and urgent_max_frames and num_taken):
        return True
    return (num_taken + 1) * max(longest, frames) <= urgent_max_frames
