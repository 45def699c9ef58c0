"""The flow engine: a queue of calls and the scheduling loop; the device side is the runner.

`submit()` is called by the servicer for each validated chunk and awaits its mel. The loop asks
its `EngineCore` (flow_service/core.py: the decisions, which bench/simulate.py drives too) for
a `Plan`, has the `FlowRunner` (flow_service/runner.py) run it on its worker
thread (own CUDA stream, CUDA graphs) so the event loop keeps accepting calls while a batch
computes, and hands each slot's result to the call in that slot. A call cancelled while waiting
leaves the queue; one cancelled while its batch runs has its row discarded. A batch that raises
fails only its own calls; one out of GPU memory is split and retried (flow_service/contain.py),
so only a row that cannot run even alone fails, with RESOURCE_EXHAUSTED naming its request. A
sticky device error (token2wav/faults.py) answers every call UNAVAILABLE, stops the loop and
calls `on_device_lost`, which takes the replica down for a restart.

Preemption: a batch of later chunks takes 10 solver steps, up to a couple of seconds at 64 rows
of long chunks. A first chunk arriving meanwhile (time to first audio) would wait for all of
them; instead, between two steps the runner asks the loop for a batch of the waiting first
chunks, runs it to the end on the same thread and stream, and resumes. Rows are independent, so
no result changes; the preempted batch's rows arrive later by the urgent batch's compute time.
With playback deadlines (calls carrying `due`), "first chunks" becomes "work whose slack is below
one solver step of the running batch" (Scheduler.is_urgent); the cost model that estimates
batch times learns from every batch run here.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flow_service import metrics
from flow_service.contain import execute_contained
from flow_service.core import EngineCore, Running
from flow_service.costmodel import CostModel, num_solver_steps
from flow_service.model import FlowModel, FlowRequest, PrefixCache
from flow_service.model.prefix_cache import readable_prefix
from flow_service.runner import GRAPH_FRAME_MULTIPLE, BetweenSteps, FlowRunner, UrgentRequest
from flow_service.scheduler import BatchPolicy, CallStatus, PendingCall, Plan, Scheduler
from token2wav.errors import DeadlineExceeded, ResourceExhausted, ServiceError, Unavailable
from token2wav.faults import RowOutOfMemory, is_device_lost

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
        graph_max_batch: int = 64,
        graph_frame_multiple: int = GRAPH_FRAME_MULTIPLE,
        graph_max_frames: int = 0,
        preempt: bool = True,
        cost: CostModel | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        self.model = model
        self.prefix_cache = prefix_cache  # the runner's; the engine drops cancelled streams
        self._chains: dict[str, list[tuple[int, asyncio.Event]]] = {}  # key -> calls in flight
        self.policy = policy
        self.cost = cost or CostModel(num_solver_steps(model))
        self.core = EngineCore(policy, self.cost, preempt)
        self.log_batches = log_batches
        self.runner = FlowRunner(
            model,
            prefix_cache=prefix_cache,
            cuda_graphs=cuda_graphs,
            graph_max_batch=graph_max_batch,
            graph_frame_multiple=graph_frame_multiple,
            graph_max_frames=graph_max_frames,
        )
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        # The preemptible batch the runner is in (runner thread; the loop thread reads it in
        # `_take_urgent`, while the runner waits for the answer).
        self._running: Running | None = None
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._futures: dict[int, asyncio.Future] = {}  # call_id -> the waiting caller's future
        # Set once a sticky device error was seen: no batch runs again in this process.
        self.device_lost: BaseException | None = None
        self.on_device_lost: Callable[[BaseException], None] | None = None  # the service's

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_ref = asyncio.get_running_loop()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="flow-scheduler")

    async def stop(self) -> None:
        self._stopping = True
        logger.info(
            "%d batches, %d of them urgent batches run between the steps of another",
            self.core.num_batches,
            self.num_preemptions,
        )
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for call in self.core.clear():
            self._fail(call, Unavailable("flow service is shutting down"))
        # Off the loop: a runner between two steps may still be waiting for the loop's answer.
        await asyncio.to_thread(self.runner.close)

    async def warmup(self, requests: list[FlowRequest]) -> None:
        """Run the model off the loop (kernels, allocator, CUDA graphs) before SERVING."""
        await self.runner.warmup(requests)

    # -- calls -------------------------------------------------------------------------------
    async def submit(
        self, request: FlowRequest, deadline: float = math.inf, due: float = math.inf
    ) -> FlowResult:
        """`deadline`: the call fails past it; `due`: its playback deadline (soft, orders it).
        With the prefix cache, a call waits until the calls of its stream
        with a smaller token_offset on this replica are done: it can only reuse what they
        stored, and its audio plays after theirs anyway."""
        key = request.cache_key if self.prefix_cache is not None else ""
        sent = self.core.clock()
        if not key:
            return await self._submit_now(request, deadline, due, sent)
        chain = self._chains.setdefault(key, [])
        earlier = [done for offset, done in chain if offset < request.token_offset]
        mine = (request.token_offset, asyncio.Event())
        chain.append(mine)
        try:
            if earlier:
                left = None if deadline == math.inf else max(0.0, deadline - self.core.clock())
                try:
                    # One coroutine, not gather(): a gather whose children are cancelled under a
                    # cancelled call logs "exception was never retrieved".
                    await asyncio.wait_for(_wait_all(earlier), left)
                except asyncio.TimeoutError:
                    metrics.DROPPED.labels("deadline").inc()
                    raise DeadlineExceeded(
                        "deadline passed while the stream's earlier chunks ran"
                    ) from None
            return await self._submit_now(request, deadline, due, sent)
        finally:
            mine[1].set()
            chain.remove(mine)
            if not chain:
                del self._chains[key]

    async def _submit_now(
        self, request: FlowRequest, deadline: float, due: float, sent: float
    ) -> FlowResult:
        if self.device_lost is not None:
            raise Unavailable("this flow replica lost its GPU and is restarting; retry another")
        call = PendingCall(
            num_seq_frames=request.num_seq_frames,
            num_out_frames=request.num_out_frames,
            is_first_chunk=request.token_offset == 0,
            deadline=deadline,
            payload=request,
            arrival=self.core.clock(),
            due=due,
            stream=request.cache_key,
            token_offset=request.token_offset,
            final=request.finalize,
            num_cached_frames=self._cached_frames(request),
            sent=sent,
        )
        self.core.add(call)  # RESOURCE_EXHAUSTED when full: at once, queue unchanged
        future = asyncio.get_running_loop().create_future()
        self._futures[call.call_id] = future
        metrics.QUEUE_DEPTH.set(len(self.core))
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            if self.prefix_cache is not None and request.cache_key:
                self.prefix_cache.drop(request.cache_key)  # the stream is likely gone
            if call.status == CallStatus.WAITING:
                call.status = CallStatus.CANCELLED  # the loop drops it before the next batch
                metrics.DROPPED.labels("cancelled_waiting").inc()
                self._wakeup.set()  # an idle loop drops it now (queue depth back to 0)
            elif call.status == CallStatus.RUNNING:
                metrics.DROPPED.labels("cancelled_running").inc()
            raise
        finally:
            self._futures.pop(call.call_id, None)

    def _cached_frames(self, request: FlowRequest) -> int:
        """What the call should read from the prefix cache: its stream's earlier calls ran
        before it (`submit`), so their blocks are in unless evicted."""
        if self.prefix_cache is None:
            return 0
        return readable_prefix(
            request.out_start_frame,
            request.num_seq_frames,
            request.streaming,
            self.prefix_cache.block,
        )

    def _fail(self, call: PendingCall, exc: Exception) -> None:
        future = self._futures.get(call.call_id)
        if future is not None and not future.done():
            future.set_exception(exc)

    # -- the loop ----------------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def num_preemptions(self) -> int:
        """Urgent batches run between the steps of another."""
        return self.core.num_preemptions

    async def _sleep_until(self, when: float) -> None:
        self._wakeup.clear()
        timeout = None if when == math.inf else max(0.0, when - self.core.clock())
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            step = self.core.step()
            self._expired(step.expired)
            if step.plan is None:
                await self._sleep_until(step.wake_at)
                continue
            plan = step.plan
            started = self.core.clock()
            try:
                outputs = await loop.run_in_executor(self.runner.executor, self._run, plan)
            except Exception as exc:  # noqa: BLE001 - the batch's calls fail, the server lives
                logger.exception("batch of %d failed", len(plan.calls))
                self._finish(plan, None, exc, started)
                if self.device_lost is not None:
                    return
                continue
            self._finish(plan, outputs, None, started)

    def _expired(self, calls: list[PendingCall]) -> None:
        """Loop thread: fail the calls that expired waiting; the queue's metrics."""
        for call in calls:
            metrics.DROPPED.labels("deadline").inc()
            self._fail(call, DeadlineExceeded("deadline passed while waiting for a batch"))
        metrics.QUEUE_DEPTH.set(len(self.core))

    def _run(self, plan: Plan, nested: bool = False) -> tuple[list[torch.Tensor], float, float]:
        """Runner thread: (outputs, wall s, own s), as FlowRunner.execute."""
        running = self.core.begin(plan, nested)
        between_steps = None
        if running is not None:
            self._running = running
            between_steps = BetweenSteps(
                self._loop_ref, self._urgent, self._take_urgent, self._run_urgent
            )
        outputs, wall, own = execute_contained(
            self.runner, [c.payload for c in plan.calls], between_steps, _count_fault
        )
        plan.path = self.runner.last_path
        if len(outputs) != len(plan.calls):
            raise SlotMismatch(f"model returned {len(outputs)} results for {len(plan.calls)} slots")
        return outputs, wall, own

    def _urgent(self) -> bool:
        """Runner thread, between two solver steps of a preemptible batch: must it give way?"""
        return (
            self.core.should_yield(self._running)
            and not self._stopping
            and self._loop_ref is not None
        )

    def _run_urgent(self, plan: Plan) -> None:
        """Runner thread: run the urgent batch to the end, then hand its results to the loop."""
        started = self.core.clock()
        try:
            result, exc = self._run(plan, nested=True), None
        except Exception as e:  # noqa: BLE001 - fails the urgent calls only
            logger.exception("urgent batch of %d failed", len(plan.calls))
            result, exc = None, e
        try:
            self._loop_ref.call_soon_threadsafe(self._finish, plan, result, exc, started)
        except RuntimeError:  # the loop closed meanwhile: nobody is left to answer
            pass

    async def _take_urgent(self, ask: UrgentRequest) -> None:
        """Loop thread: hand the urgent work to the runner as one batch."""
        if not ask.open():
            return  # the runner stopped waiting; take nothing out of the queue
        plan = None
        try:
            if self._stopping:
                return  # stop() fails the waiting calls; none may slip into a batch now
            step = self.core.take_urgent(self._running)
            self._expired(step.expired)
            plan = step.plan
            if plan is not None:
                metrics.PREEMPTIONS.inc()
        except Exception:  # noqa: BLE001 - nobody reads this coroutine's result
            logger.exception("forming an urgent batch failed")
            plan = None
        finally:
            ask.deliver(plan)

    def _finish(self, plan: Plan, result, exc: Exception | None, started: float) -> None:
        done = self.core.finish(plan, None if exc is not None else result[2])
        n = len(plan.calls)
        metrics.BATCH_SIZE.observe(n)
        metrics.BATCH_PADDED_FRAMES.observe(plan.num_padded_frames)
        metrics.PADDING_EFFICIENCY.observe(plan.padding_efficiency)
        for reason, count in plan.left_out.items():
            metrics.LEFT_OUT.labels(reason).inc(count)
        if exc is not None:
            error = exc if isinstance(exc, ServiceError) else RuntimeError(f"batch failed: {exc}")
            if is_device_lost(exc):
                error = Unavailable("this flow replica lost its GPU; retry another")
            for call in plan.calls:
                call.status = CallStatus.DONE
                self._fail(call, error)
            if is_device_lost(exc):
                self._lose_device(exc)
            return
        outputs, compute_s, own_s = result
        metrics.COMPUTE.observe(own_s)  # GPU time of this batch alone: the sum stays <= wall
        metrics.CAPACITY.set(self.cost.capacity_frames_per_s)
        late = sum(c.due < done for c in plan.calls)
        if late:
            metrics.LATE.inc(late)
        if self.log_batches:
            lengths = sorted(c.num_seq_frames for c in plan.calls)
            logger.info(
                "batch %d%s: %d reqs, T %d..%d, padded %d, efficiency %.2f, first-chunks %d, "
                "%s, %.1f ms (own %.1f), waited %.1f ms%s",
                self.core.num_batches,
                " (urgent, between steps)" if plan.urgent else "",
                n,
                lengths[0],
                lengths[-1],
                plan.num_padded_frames,
                plan.padding_efficiency,
                sum(c.is_first_chunk for c in plan.calls),
                plan.path,
                compute_s * 1e3,
                own_s * 1e3,
                (started - min(c.arrival for c in plan.calls)) * 1e3,
                "".join(f", left out for {k} {n}" for k, n in plan.left_out.items()),
            )
        for slot, call in enumerate(plan.calls):
            call.status = CallStatus.DONE
            future = self._futures.get(call.call_id)
            if future is None or future.done():
                continue  # cancelled while running: its row is discarded
            if isinstance(outputs[slot], RowOutOfMemory):
                rid = call.payload.cache_key or "(no request_id)"
                future.set_exception(ResourceExhausted(f"request {rid}: {outputs[slot]}"))
                continue
            queue_s = started - call.arrival
            metrics.QUEUE_WAIT.observe(queue_s)
            future.set_result(
                FlowResult(outputs[slot], queue_s * 1e3, compute_s * 1e3, n, plan.num_padded_frames)
            )

    def _lose_device(self, exc: BaseException) -> None:
        """Loop thread: a sticky device error. The waiting calls get UNAVAILABLE (the gateway
        retries them on another replica), no batch runs again, and the service is told."""
        if self.device_lost is not None:
            return
        self.device_lost = exc
        metrics.GPU_FAULTS.labels("device_lost").inc()
        logger.critical("device lost (%s); failing %d waiting calls", exc, len(self.core))
        for call in self.core.clear():
            call.status = CallStatus.DONE
            self._fail(call, Unavailable("this flow replica lost its GPU; retry another"))
        metrics.QUEUE_DEPTH.set(0)
        if self.on_device_lost is not None:
            self.on_device_lost(exc)


def _count_fault(kind: str) -> None:
    metrics.GPU_FAULTS.labels(kind).inc()


async def _wait_all(events: list[asyncio.Event]) -> None:
    for event in events:
        await event.wait()
