"""The flow engine: a queue of calls, the scheduling loop, and the runner thread.

`submit()` is called by the servicer for each validated chunk and awaits its mel. The loop asks
the `Scheduler` for a `Plan`, runs the model on a worker thread (its own CUDA stream) so the
event loop keeps accepting calls while a batch computes, and hands each slot's result to the
call in that slot. A call cancelled while waiting leaves the queue; one cancelled while its
batch runs has its row discarded. A batch that raises fails only its own calls.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from flow_service import metrics
from flow_service.model import ChunkRequest, FlowModel
from flow_service.scheduler import BatchPolicy, CallStatus, PendingCall, Plan, Scheduler
from token2wav.errors import DeadlineExceeded, ServiceError, Unavailable

logger = logging.getLogger(__name__)


class SlotMismatch(RuntimeError):
    """The model returned a different number of results than the batch had slots (invariant 5)."""


@dataclass(frozen=True)
class FlowResult:
    mel: torch.Tensor  # (80, frames) float32 CPU
    queue_ms: float
    compute_ms: float
    batch_size: int
    padded_frames: int


class FlowEngine:
    def __init__(
        self,
        model: FlowModel,
        policy: BatchPolicy,
        log_batches: bool = False,
        cuda_graphs: bool = True,
        graph_max_batch: int = 8,
        graph_frame_multiple: int = 100,
    ):
        self.model = model
        self.policy = policy
        self.scheduler = Scheduler(policy)
        self.log_batches = log_batches
        self.device = next(model.parameters()).device
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="flow-runner")
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Small batches are launch-bound (~900 kernels per solver step): replaying CUDA graphs
        # cuts a bf16 step at B=1 from 18 to 3.6 ms on an H200. Shapes are bucketed (requests
        # to a power of two, frames to a multiple) so a few dozen graphs cover the workload;
        # large batches are compute-bound and run eagerly.
        self._graphs = None
        if cuda_graphs and self._stream is not None:
            from flow_service.model import GraphedEstimator

            self._graphs = GraphedEstimator(model.decoder.estimator, max_graphs=128)
        self.graph_max_batch = graph_max_batch
        self.graph_frame_multiple = graph_frame_multiple
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._futures: dict[int, asyncio.Future] = {}  # call_id -> the waiting caller's future
        self.num_batches = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="flow-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for call in self.scheduler.waiting:
            self._fail(call, Unavailable("flow service is shutting down"))
        self.scheduler.waiting.clear()
        self._executor.shutdown(wait=True)

    async def warmup(self, requests: list[ChunkRequest]) -> None:
        """Run the model off the loop (kernels, allocator, CUDA graphs) before SERVING."""
        loop = asyncio.get_running_loop()
        for batch in [requests, *self.graph_warmup_requests()]:
            await loop.run_in_executor(self._executor, self._generate, batch)
        if self._graphs is not None:
            logger.info("captured %d CUDA graphs", len(self._graphs))

    # -- calls -------------------------------------------------------------------------------
    async def submit(self, request: ChunkRequest, deadline: float = math.inf) -> FlowResult:
        call = PendingCall(
            num_seq_frames=request.num_seq_frames,
            num_out_frames=request.num_out_frames,
            is_first_chunk=request.token_offset == 0,
            deadline=deadline,
            payload=request,
        )
        self.scheduler.add(call)  # RESOURCE_EXHAUSTED when full: at once, queue unchanged
        future = asyncio.get_running_loop().create_future()
        self._futures[call.call_id] = future
        metrics.QUEUE_DEPTH.set(len(self.scheduler))
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            if call.status == CallStatus.WAITING:
                call.status = CallStatus.CANCELLED  # the loop drops it before the next batch
                metrics.DROPPED.labels("cancelled_waiting").inc()
            elif call.status == CallStatus.RUNNING:
                metrics.DROPPED.labels("cancelled_running").inc()
            raise
        finally:
            self._futures.pop(call.call_id, None)

    def _fail(self, call: PendingCall, exc: Exception) -> None:
        future = self._futures.get(call.call_id)
        if future is not None and not future.done():
            future.set_exception(exc)

    # -- the loop ----------------------------------------------------------------------------
    async def _sleep_until(self, when: float) -> None:
        self._wakeup.clear()
        timeout = None if when == math.inf else max(0.0, when - time.monotonic())
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = time.monotonic()
            for call in self.scheduler.drop_finished(now):
                metrics.DROPPED.labels("deadline").inc()
                self._fail(call, DeadlineExceeded("deadline passed while waiting for a batch"))
            metrics.QUEUE_DEPTH.set(len(self.scheduler))
            start_at = self.scheduler.ready_at(now)
            if start_at > now:
                await self._sleep_until(min(start_at, self._next_deadline()))
                continue
            plan = self.scheduler.schedule()
            if plan is None:
                continue
            started = time.monotonic()
            try:
                outputs = await loop.run_in_executor(self._executor, self._run, plan)
            except Exception as exc:  # noqa: BLE001 - the batch's calls fail, the server lives
                logger.exception("batch of %d failed", len(plan.calls))
                self._finish(plan, None, exc, started)
                continue
            self._finish(plan, outputs, None, started)

    def _next_deadline(self) -> float:
        return min((c.deadline for c in self.scheduler.waiting), default=math.inf)

    def _generate(self, requests: list[ChunkRequest]) -> list[torch.Tensor]:
        if self._stream is None:
            return self.model.generate(requests)
        num = len(requests)
        with torch.cuda.stream(self._stream):
            if self._graphs is not None and num <= self.graph_max_batch:
                # Pad the batch to a power of two with copies of a real row (rows are
                # independent; the copies' outputs are dropped) so the graph shape repeats.
                bucket = 1 << (num - 1).bit_length()
                padded = requests + [requests[-1]] * (bucket - num)
                outputs = self.model.generate(
                    padded, estimator=self._graphs, frame_multiple=self.graph_frame_multiple
                )[:num]
            else:
                outputs = self.model.generate(requests)
        self._stream.synchronize()
        return outputs

    def graph_warmup_requests(self, max_frames: int = 800) -> list[list[ChunkRequest]]:
        """Batches covering every graph bucket up to `max_frames`, to capture before SERVING."""
        if self._graphs is None:
            return []
        from flow_service.app import warmup_batch

        sizes = [
            1 << i
            for i in range(self.graph_max_batch.bit_length())
            if 1 << i <= self.graph_max_batch
        ]
        step = self.graph_frame_multiple
        return [warmup_batch(b, t) for b in sizes for t in range(step, max_frames + 1, step)]

    def _run(self, plan: Plan) -> tuple[list[torch.Tensor], float]:
        t0 = time.perf_counter()
        outputs = self._generate([c.payload for c in plan.calls])
        if len(outputs) != len(plan.calls):
            raise SlotMismatch(f"model returned {len(outputs)} results for {len(plan.calls)} slots")
        return outputs, time.perf_counter() - t0

    def _finish(self, plan: Plan, result, exc: Exception | None, started: float) -> None:
        done = time.monotonic()
        self.scheduler.mark_busy_until(done)
        self.num_batches += 1
        n = len(plan.calls)
        metrics.BATCH_SIZE.observe(n)
        metrics.BATCH_PADDED_FRAMES.observe(plan.num_padded_frames)
        metrics.PADDING_EFFICIENCY.observe(plan.padding_efficiency)
        if exc is not None:
            error = exc if isinstance(exc, ServiceError) else RuntimeError(f"batch failed: {exc}")
            for call in plan.calls:
                call.status = CallStatus.DONE
                self._fail(call, error)
            return
        outputs, compute_s = result
        metrics.COMPUTE.observe(compute_s)
        if self.log_batches:
            lengths = sorted(c.num_seq_frames for c in plan.calls)
            logger.info(
                "batch %d: %d reqs, T %d..%d, padded %d, efficiency %.2f, first-chunks %d, %.1f ms",
                self.num_batches,
                n,
                lengths[0],
                lengths[-1],
                plan.num_padded_frames,
                plan.padding_efficiency,
                sum(c.is_first_chunk for c in plan.calls),
                compute_s * 1e3,
            )
        for slot, call in enumerate(plan.calls):
            call.status = CallStatus.DONE
            future = self._futures.get(call.call_id)
            if future is None or future.done():
                continue  # cancelled while running: its row is discarded
            queue_s = started - call.arrival
            metrics.QUEUE_WAIT.observe(queue_s)
            future.set_result(
                FlowResult(outputs[slot], queue_s * 1e3, compute_s * 1e3, n, plan.num_padded_frames)
            )
