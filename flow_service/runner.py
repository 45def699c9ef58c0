"""The runner: owns the model on its device (the worker thread, the CUDA stream, the CUDA graphs)
and runs one batch of `FlowRequest`s there.

It sees rows, never calls, queues or deadlines: the engine (`flow_service/engine.py`) decides what
runs and when, including whether a batch may give way between two solver steps. The runner only
does the plumbing of that: between two steps it asks `BetweenSteps.urgent()`, synchronizes its
stream, asks the loop thread for an urgent batch (`UrgentRequest`) and runs it to the end on the
same thread and stream, timing it apart from the batch it interrupted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from flow_service.model import FlowModel, FlowRequest, PrefixCache
from flow_service.warmup import warmup_batch
from token2wav.faults import FaultInjector

logger = logging.getLogger(__name__)


class UrgentRequest:
    """The runner's request for an urgent batch, answered on the loop thread. A runner that
    gives up (timeout) closes it first, so a batch is never taken out of the queue unseen."""

    def __init__(self):
        self._lock = threading.Lock()
        self._answered = threading.Event()
        self._closed = False
        self._batch: Any = None

    def open(self) -> bool:
        """Loop thread, before taking calls: False once the runner has given up. The lock
        stays held until deliver()."""
        self._lock.acquire()
        if self._closed:
            self._lock.release()
            return False
        return True

    def deliver(self, batch: Any) -> None:
        self._batch = batch
        self._answered.set()
        self._lock.release()

    def wait(self, timeout: float) -> Any:
        if self._answered.wait(timeout):
            return self._batch
        with self._lock:  # either the loop delivered meanwhile, or it never will
            self._closed = True
            return self._batch


@dataclass(frozen=True)
class BetweenSteps:
    """What the runner asks between two solver steps of a batch that may give way."""

    loop: asyncio.AbstractEventLoop | None  # the loop thread that answers `take_urgent`
    urgent: Callable[[], bool]  # runner thread: must an urgent batch run now?
    take_urgent: Callable[[UrgentRequest], Awaitable[None]]  # loop thread: deliver one or None
    run_urgent: Callable[[Any], None]  # runner thread: run it and hand its results to the loop


GRAPH_ROW_STEP = 8


def graph_rows(num_rows: int) -> int:
    """The row bucket a graphed batch is padded to: a power of two up to 8, then a multiple
    of 8 (a power of two would nearly double a batch of 33; past 8 rows the padding is compute,
    not launches)."""
    if num_rows <= GRAPH_ROW_STEP:
        return 1 << (num_rows - 1).bit_length()
    return -(-num_rows // GRAPH_ROW_STEP) * GRAPH_ROW_STEP


def graph_fits(num_rows: int, longest: int, max_rows: int, max_frames: int) -> bool:
    """Whether a batch of `num_rows` whose longest DiT sequence is `longest` frames is one
    graphs take: at most `max_rows` rows and, unless `max_frames` is 0, at most that much
    work (rows x longest); past it a batch is compute-bound and runs eagerly (FlowRunner)."""
    return num_rows <= max_rows and not (max_frames and num_rows * longest > max_frames)


class FlowRunner:
    """`execute(requests)` runs one batch on the worker thread; results come back by row."""

    def __init__(
        self,
        model: FlowModel,
        prefix_cache: PrefixCache | None = None,
        cuda_graphs: bool = True,
        graph_max_batch: int = 64,
        graph_frame_multiple: int = 100,
        graph_max_frames: int = 0,
    ):
        self.model = model
        # Keys/values of streams' complete earlier blocks (eager batches only: a graph's shapes
        # are fixed, so a graphed batch recomputes its prefix).
        self.prefix_cache = prefix_cache
        self.device = next(model.parameters()).device
        # One worker: batches run one after another, while the event loop keeps accepting calls.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="flow-runner")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Small batches are launch-bound (~900 kernels per solver step), so they replay CUDA
        # graphs. Shapes are bucketed (requests by `graph_rows`, frames to a multiple) so a few
        # dozen graphs cover the workload; larger batches run eagerly. Eager steps stay
        # launch-bound well past 8 rows at first-chunk lengths, hence graphs up to
        # --graph-max-batch rows (the timings: docs/DESIGN.md "Prefix cache").
        self.graphs = None
        if cuda_graphs and self.stream is not None:
            from flow_service.model import GraphedEstimator

            self.graphs = GraphedEstimator(model.decoder.estimator, max_graphs=128)
        self.graph_max_batch = graph_max_batch
        self.graph_frame_multiple = graph_frame_multiple
        # Past this much work (rows x longest sequence, in frames; 0 = no bound) a batch is
        # compute-bound even eagerly, and eager then wins: no padding to the graph's buckets
        # (a 650-frame final call runs as 700) and the prefix cache (a 10 s stream's later
        # calls compute 100-200 new frames instead of 300-500; measured in docs/DESIGN.md
        # "Prefix cache").
        self.graph_max_frames = graph_max_frames
        self._nested_s = 0.0  # runner thread only: time spent in urgent batches
        self.faults: FaultInjector | None = None  # tests only: errors raised before a batch

    def graphed(self, requests: list[FlowRequest]) -> bool:
        """Whether this batch replays CUDA graphs (else it runs eagerly, with the cache)."""
        longest = max(req.num_seq_frames for req in requests)
        return self.graphs is not None and graph_fits(
            len(requests), longest, self.graph_max_batch, self.graph_max_frames
        )

    async def warmup(self, requests: list[FlowRequest]) -> None:
        """Run the model off the loop (kernels, allocator, CUDA graphs) before SERVING."""
        loop = asyncio.get_running_loop()
        for batch in [requests, *self.graph_warmup_requests()]:
            await loop.run_in_executor(self.executor, self.generate, batch)
        if self.graphs is not None:
            logger.info("captured %d CUDA graphs", len(self.graphs))

    def graph_warmup_requests(self, max_frames: int = 800) -> list[list[FlowRequest]]:
        """Batches covering every graph bucket up to `max_frames`, to capture before SERVING."""
        if self.graphs is None:
            return []
        sizes = sorted({graph_rows(n) for n in range(1, self.graph_max_batch + 1)})
        step = self.graph_frame_multiple
        return [warmup_batch(b, t) for b in sizes for t in range(step, max_frames + 1, step)]

    def close(self) -> None:
        """Wait for the batch in progress (blocking: call it off the loop)."""
        self.executor.shutdown(wait=True)

    # -- the worker thread -------------------------------------------------------------------
    def generate(self, requests: list[FlowRequest], between_steps=None) -> list[torch.Tensor]:
        cache = self.prefix_cache
        if self.stream is None:
            return self.model.generate(requests, between_steps=between_steps, prefix_cache=cache)
        num = len(requests)
        with torch.cuda.stream(self.stream):
            if self.graphed(requests):
                # Pad the batch to its row bucket with copies of a real row (rows are
                # independent; the copies' outputs are dropped) so the graph shape repeats.
                padded = requests + [requests[-1]] * (graph_rows(num) - num)
                outputs = self.model.generate(
                    padded,
                    estimator=self.graphs,
                    frame_multiple=self.graph_frame_multiple,
                    between_steps=between_steps,
                )[:num]
                if cache is not None:  # graphed rows skip the cache; finished streams leave it
                    for req in requests:
                        if req.finalize and req.cache_key:
                            cache.drop(req.cache_key)
            else:
                outputs = self.model.generate(
                    requests, between_steps=between_steps, prefix_cache=cache
                )
        self.stream.synchronize()
        return outputs

    def execute(
        self, requests: list[FlowRequest], between_steps: BetweenSteps | None = None
    ) -> tuple[list[torch.Tensor], float, float]:
        """Worker thread: (outputs, wall s, own s). Wall time includes any urgent batch run
        between this batch's steps (what its callers waited); own time does not."""
        if self.faults is not None:
            self.faults.check(requests)
        t0 = time.perf_counter()
        nested_before = self._nested_s
        hook = None
        if between_steps is not None:
            # Eager batches (more rows than graphs take) have long steps: look at the queue
            # when the GPU has finished each one, not when the CPU has queued it (it runs a
            # step or more ahead), so an urgent batch starts on an idle card; the sync costs
            # microseconds a step. Short graphed steps keep CPU/GPU overlap and sync only
            # when an urgent batch is wanted.
            eager = not self.graphed(requests)
            hook = functools.partial(self._between_steps, between_steps, eager)
        outputs = self.generate(requests, between_steps=hook)
        wall = time.perf_counter() - t0
        return outputs, wall, wall - (self._nested_s - nested_before)

    def _between_steps(self, ask_engine: BetweenSteps, sync_every_step: bool) -> None:
        """Worker thread, between two solver steps of a batch that may give way."""
        urgent = ask_engine.urgent()
        if self.stream is not None and (sync_every_step or urgent):
            self.stream.synchronize()  # an urgent batch then starts on an idle card
        if not urgent:
            return
        ask = UrgentRequest()
        try:
            asyncio.run_coroutine_threadsafe(ask_engine.take_urgent(ask), ask_engine.loop)
        except RuntimeError:  # the loop is closed
            return
        batch = ask.wait(timeout=5.0)
        if batch is None:
            return
        t0 = time.perf_counter()
        try:
            ask_engine.run_urgent(batch)
        finally:
            self._nested_s += time.perf_counter() - t0
