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
from flow_service.model.prefix_cache import PrefixPlan, PrefixStep, query_bucket
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
GRAPH_FRAME_MULTIPLE = 100  # a plain graphed batch's frames are padded to a multiple of this
# A graphed prefix solve pads each row's cached prefix to a multiple of this many frames (4
# blocks), so a few graphs per row bucket cover the prefixes of 30 s streams; the padding is
# masked keys, cheap next to the queries' own compute.
GRAPH_PREFIX_MULTIPLE = 200
# Prefix graphs kept (least recently used go first): every shape the warm-up captures
# (`prefix_graph_shapes`: 228 at the default --graph-max-frames) and this many met later.
PREFIX_GRAPHS_SPARE = 64
PLAIN_GRAPHS_KEPT = 128  # graphs of batches that do not read the cache: 55 from the warm-up
# The warm-up captures plain graphs up to this many frames and prefix graphs up to this padded
# prefix; a shape past them is captured inside the first batch that meets it.
WARMUP_MAX_FRAMES = 800
WARMUP_MAX_PREFIX = 800


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


def row_buckets(max_rows: int) -> list[int]:
    """Every `graph_rows` bucket of batches up to `max_rows` rows."""
    return sorted({graph_rows(n) for n in range(1, max_rows + 1)})


def plain_graph_shapes(
    max_rows: int, max_frames: int, frame_multiple: int, longest: int = WARMUP_MAX_FRAMES
) -> list[tuple[int, int]]:
    """(rows, padded frames) of the plain graphs the warm-up captures: every row bucket and
    frame bucket up to `longest` that `FlowRunner.graphed` sends to graphs (`max_rows`,
    `max_frames`: its bounds; a larger warm-up batch would run eagerly and capture nothing)."""
    return [
        (rows, t)
        for rows in row_buckets(max_rows)
        for t in range(frame_multiple, longest + 1, frame_multiple)
        if graph_fits(rows, t, max_rows, max_frames)
    ]


def prefix_graph_key(rows: int, prefix: int, queries: int, block: int) -> tuple[int, int, int]:
    """(rows, padded prefix, query frames) of the prefix graph a batch replays: rows to their
    bucket, the longest cached prefix to GRAPH_PREFIX_MULTIPLE, the longest query run to its
    `query_bucket` of blocks (flow_service/model/prefix_cache.py `solve_with_prefix`)."""
    multiple = max(GRAPH_PREFIX_MULTIPLE, block)
    padded_prefix = -(-prefix // multiple) * multiple
    return graph_rows(rows), padded_prefix, query_bucket(-(-queries // block)) * block


def prefix_graph_shapes(
    max_rows: int,
    max_frames: int,
    block: int,
    scratch_query_blocks: int,
    max_prefix: int = WARMUP_MAX_PREFIX,
) -> list[tuple[int, int, int]]:
    """(rows, padded prefix, query frames) of the prefix graphs captured before serving:
    every row bucket, padded prefix up to `max_prefix` frames and `query_bucket` up to
    WARMUP_MAX_FRAMES query frames for which some batch of that key is one `FlowRunner.graphed`
    sends to graphs (`max_rows`, `max_frames`: its bounds): its fewest rows, its shortest
    prefix and queries. Other shapes are captured when first met, inside a batch: ~0.1 s
    each, which a burst of new streams pays once per shape (the closed loop of 64 measured
    it: docs/bench/2026-12-06-h100.md)."""
    buckets = row_buckets(max_rows)
    fewest = dict(zip(buckets, [1] + [b + 1 for b in buckets[:-1]], strict=True))

    def shortest(queries: int, prefix: int) -> int:
        """The least work per row (FlowRunner.graphed's) of a batch of this key: its longest
        query run and its longest prefix may be different rows'."""
        fewest_queries = queries // 2 + block if queries > block else block
        return max(fewest_queries, max(0, prefix - GRAPH_PREFIX_MULTIPLE + block) // 2 + block)

    return [
        (rows, prefix, queries)
        for queries in (block << i for i in range((WARMUP_MAX_FRAMES // block).bit_length()))
        for rows in buckets
        for prefix in range(0, max_prefix + 1, GRAPH_PREFIX_MULTIPLE)
        if graph_fits(fewest[rows], shortest(queries, prefix), max_rows, max_frames)
        and rows * (queries // block) <= scratch_query_blocks
    ]


class FlowRunner:
    """`execute(requests)` runs one batch on the worker thread; results come back by row."""

    def __init__(
        self,
        model: FlowModel,
        prefix_cache: PrefixCache | None = None,
        cuda_graphs: bool = True,
        graph_max_batch: int = 64,
        graph_frame_multiple: int = GRAPH_FRAME_MULTIPLE,
        graph_max_frames: int = 0,
    ):
        self.model = model
        # Keys/values of streams' complete earlier blocks: a later call of a stream computes
        # only its new frames, eagerly or through the prefix graphs.
        self.prefix_cache = prefix_cache
        self.device = next(model.parameters()).device
        # One worker: batches run one after another, while the event loop keeps accepting calls.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="flow-runner")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.graph_max_batch = graph_max_batch
        self.graph_frame_multiple = graph_frame_multiple
        # Past this much work (rows x longest sequence, in frames; 0 = no bound) a batch is
        # compute-bound even eagerly, and eager then wins: no padding to the graph's buckets
        # (a 650-frame final call runs as 700) and the prefix cache (a 10 s stream's later
        # calls compute 100-200 new frames instead of 300-500; measured in docs/DESIGN.md
        # "Prefix cache").
        self.graph_max_frames = graph_max_frames
        # Small batches are launch-bound (~900 kernels per solver step), so they replay CUDA
        # graphs. Shapes are bucketed (requests by `graph_rows`, frames to a multiple) so a few
        # dozen graphs cover the workload; larger batches run eagerly. Eager steps stay
        # launch-bound well past 8 rows at first-chunk lengths, hence graphs up to
        # --graph-max-batch rows (the timings: docs/DESIGN.md "Prefix cache").
        self.graphs = None
        self.prefix_graphs = None  # graphs of PrefixStep: rows x queries over a cached prefix
        if cuda_graphs and self.stream is not None:
            from flow_service.model import GraphedEstimator

            self.graphs = GraphedEstimator(model.decoder.estimator, max_graphs=PLAIN_GRAPHS_KEPT)
            if prefix_cache is not None:
                step = PrefixStep(model.decoder.estimator, prefix_cache)
                self.prefix_graphs = GraphedEstimator(
                    step,
                    max_graphs=len(self.prefix_graph_shapes()) + PREFIX_GRAPHS_SPARE,
                    always_copy=PrefixStep.ALWAYS_COPY,
                    share=self.graphs,
                )
        self._nested_s = 0.0  # runner thread only: time spent in urgent batches
        # Runner thread only: how the latest batch ran, for --log-batches ("graph+prefix",
        # "eager", ...; "captured N" when it captured graphs, ~0.1 s each).
        self.last_path = ""
        self.faults: FaultInjector | None = None  # tests only: errors raised before a batch

    def graphed(self, requests: list[FlowRequest], plan: PrefixPlan | None = None) -> bool:
        """Whether this batch replays CUDA graphs (else it runs eagerly). Its work per row is
        the frames it computes, plus half its cached prefix when `plan` reads one: the weight
        with which the bound fell where graphed and eager prefix solves measured alike
        (docs/DESIGN.md "Graphed batches read and write it too"). A prefix solve whose query
        blocks would not fit the cache's scratch runs eagerly."""
        if plan is None or self.prefix_graphs is None:
            longest = max(req.num_seq_frames for req in requests)
        else:
            longest = max(
                req.num_seq_frames - row.prefix // 2
                for req, row in zip(requests, plan.rows, strict=True)
            )
            queries = max(
                req.num_seq_frames - row.prefix
                for req, row in zip(requests, plan.rows, strict=True)
            )
            query_blocks = graph_rows(len(requests)) * query_bucket(-(-queries // plan.cache.block))
            if plan.active and query_blocks > plan.cache.scratch_query_blocks:
                return False
        return self.graphs is not None and graph_fits(
            len(requests), longest, self.graph_max_batch, self.graph_max_frames
        )

    async def warmup(self, requests: list[FlowRequest]) -> None:
        """Run the model off the loop (kernels, allocator, CUDA graphs) before SERVING."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.executor, self.generate, requests)
        for batch in self.graph_warmup_requests():
            # without the cache: these capture the graphs of batches that do not read it
            # (final calls, or the cache off), which the prefix path would otherwise take
            await loop.run_in_executor(self.executor, self.generate, batch, None, False)
        if self.prefix_graphs is not None:
            await loop.run_in_executor(self.executor, self.capture_prefix_graphs)
        if self.graphs is not None:
            logger.info(
                "captured %d CUDA graphs, %d over the prefix cache",
                len(self.graphs),
                len(self.prefix_graphs or ()),
            )

    def prefix_graph_shapes(self) -> list[tuple[int, int, int]]:
        """`prefix_graph_shapes` under this runner's bounds and cache."""
        cache = self.prefix_cache
        return prefix_graph_shapes(
            self.graph_max_batch, self.graph_max_frames, cache.block, cache.scratch_query_blocks
        )

    def capture_prefix_graphs(self) -> None:
        """Worker thread: capture `prefix_graph_shapes`."""
        step = self.prefix_graphs.estimator
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for rows, prefix, queries in self.prefix_graph_shapes():
                self.prefix_graphs(*step.example_args(rows, prefix, queries))
        self.stream.synchronize()

    def graph_warmup_requests(self) -> list[list[FlowRequest]]:
        """Batches covering `plain_graph_shapes`, to capture before SERVING."""
        if self.graphs is None:
            return []
        shapes = plain_graph_shapes(
            self.graph_max_batch, self.graph_max_frames, self.graph_frame_multiple
        )
        return [warmup_batch(rows, t) for rows, t in shapes]

    def close(self) -> None:
        """Wait for the batch in progress (blocking: call it off the loop)."""
        self.executor.shutdown(wait=True)

    # -- the worker thread -------------------------------------------------------------------
    def generate(
        self,
        requests: list[FlowRequest],
        ask_engine: BetweenSteps | None = None,
        use_cache: bool = True,
    ) -> list[torch.Tensor]:
        cache = self.prefix_cache if use_cache else None
        if self.stream is None:
            hook = self._hook(ask_engine, sync_every_step=False)
            self.last_path = "cpu"
            return self.model.generate(requests, between_steps=hook, prefix_cache=cache)
        self.model.validate(requests)  # before the plan pins blocks
        plan = cache.plan(requests) if cache is not None else None
        graphed = self.graphed(requests, plan)
        # Eager batches (more rows than graphs take) have long steps: look at the queue when
        # the GPU has finished each one, not when the CPU has queued it (it runs a step or more
        # ahead), so an urgent batch starts on an idle card; the sync costs microseconds a
        # step. Short graphed steps keep CPU/GPU overlap and sync only when an urgent batch is
        # wanted.
        hook = self._hook(ask_engine, sync_every_step=not graphed)
        # before the solve: committing the plan unpins its blocks, and a row that only stored
        # would no longer look active
        path = ("graph" if graphed else "eager") + ("+prefix" if plan and plan.active else "")
        num = len(requests)
        captures = self._num_captures()
        with torch.cuda.stream(self.stream):
            if graphed:
                # Pad the batch to its row bucket with copies of a real row (rows are
                # independent; the copies' outputs are dropped) so the graph shape repeats.
                padded = requests + [requests[-1]] * (graph_rows(num) - num)
                if plan is not None:
                    plan.pad(len(padded))
                outputs = self.model.generate(
                    padded,
                    estimator=self.graphs,
                    frame_multiple=self.graph_frame_multiple,
                    between_steps=hook,
                    prefix_cache=cache,
                    plan=plan,
                    prefix_step=self.prefix_graphs,
                    prefix_multiple=GRAPH_PREFIX_MULTIPLE,
                )[:num]
            else:
                outputs = self.model.generate(
                    requests, between_steps=hook, prefix_cache=cache, plan=plan
                )
        self.stream.synchronize()
        captured = self._num_captures() - captures  # an urgent batch's between steps included
        self.last_path = f"{path}, captured {captured}" if captured else path
        return outputs

    def _num_captures(self) -> int:
        return sum(g.num_captures for g in (self.graphs, self.prefix_graphs) if g is not None)

    def _hook(self, ask_engine: BetweenSteps | None, sync_every_step: bool):
        if ask_engine is None:
            return None
        return functools.partial(self._between_steps, ask_engine, sync_every_step)

    def execute(
        self, requests: list[FlowRequest], between_steps: BetweenSteps | None = None
    ) -> tuple[list[torch.Tensor], float, float]:
        """Worker thread: (outputs, wall s, own s). Wall time includes any urgent batch run
        between this batch's steps (what its callers waited); own time does not."""
        if self.faults is not None:
            self.faults.check(requests)
        t0 = time.perf_counter()
        nested_before = self._nested_s
        outputs = self.generate(requests, between_steps)
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
