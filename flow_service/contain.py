"""Fault containment around `FlowRunner.execute`: an out-of-memory splits the batch, never
fails it (token2wav/faults.py says which errors are which).

Rows are independent (invariant 1), so a batch that ran out of memory is re-run as two halves,
recursively; a row out of memory alone comes back as a `RowOutOfMemory` in its slot and the
engine fails that call alone. The retries run without giving way between steps (an urgent batch
waits for them, as for any batch of first chunks) and after the failed rows' prefix-cache
entries were dropped (a batch cut short may have stored part of its blocks; a miss recomputes
the same mel). Any other error goes up unchanged: a sticky device error to the engine, which
takes the replica down, and a bug fails the batch's calls as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from flow_service.model import FlowRequest
from flow_service.runner import BetweenSteps, FlowRunner
from token2wav.faults import (
    RowOutOfMemory,
    free_device_memory,
    is_out_of_memory,
    without_frames,
)

logger = logging.getLogger(__name__)


def execute_contained(
    runner: FlowRunner,
    requests: list[FlowRequest],
    between_steps: BetweenSteps | None = None,
    count: Callable[[str], None] = lambda kind: None,
) -> tuple[list[torch.Tensor | RowOutOfMemory], float, float]:
    """Worker thread: as `runner.execute`, (outputs by slot, wall s, own s), except that an
    out-of-memory costs only the rows that cannot run even alone. `count(kind)` is told of
    every `oom_split` and `oom_row`."""
    try:
        return runner.execute(requests, between_steps)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        cause = without_frames(exc)
    free_device_memory()
    if runner.prefix_cache is not None:
        for req in requests:
            if req.cache_key:
                runner.prefix_cache.drop(req.cache_key)
    if len(requests) == 1:
        count("oom_row")
        logger.error("flow row %s out of memory alone: %s", requests[0].cache_key or "-", cause)
        return [RowOutOfMemory(cause)], 0.0, 0.0
    count("oom_split")
    half = len(requests) // 2
    logger.warning(
        "flow batch of %d out of memory; retrying as %d + %d",
        len(requests),
        half,
        len(requests) - half,
    )
    outputs, wall, own = [], 0.0, 0.0
    for part in (requests[:half], requests[half:]):
        out, w, o = execute_contained(runner, part, None, count)
        outputs += out
        wall += w
        own += o
    return outputs, wall, own
