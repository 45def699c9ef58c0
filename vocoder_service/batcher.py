"""The batcher: decides what runs. Each batch takes at most one ready chunk per session (a session's
chunks depend on each other through its state), least slack first, and advances them all in one
model call in the worker thread; results go back to the manager by slot. While some ready chunk
has less slack than `urgent_slack_ms` (a first chunk), a batch takes only such urgent chunks,
within `urgent_max_frames`, and the others run in the next batch (`SessionManager.take_ready`).

`max_batch_sessions=1` turns batching across sessions off through the same code path (the A/B
of the benchmark). The batcher touches no tensors: the runner does.

GPU faults (token2wav/faults.py): a chunk out of memory even alone is refused with
RESOURCE_EXHAUSTED naming its request (its session goes on); a sticky device error fails every
chunk of the batch with UNAVAILABLE (the gateway moves those sessions to another replica), stops
the loop and calls `on_device_lost`, which takes the replica down for a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from token2wav.errors import ResourceExhausted, Unavailable
from token2wav.faults import RowOutOfMemory, is_device_lost
from vocoder_service import metrics
from vocoder_service.chunks import MelChunk
from vocoder_service.config import BatcherConfig
from vocoder_service.manager import SessionManager
from vocoder_service.runner import BatchOutput, HiFTRunner

logger = logging.getLogger(__name__)


@dataclass
class BatchPlan:
    chunks: list[MelChunk]  # [num_slots] one per session; slot i of the batch is chunks[i]
    started_at: float  # manager clock, for queue time

    @property
    def num_slots(self) -> int:
        return len(self.chunks)


class Batcher:
    def __init__(self, manager: SessionManager, runner: HiFTRunner, config: BatcherConfig):
        self.manager = manager
        self.runner = runner
        self.config = config
        # One worker: batches run one after another (each advances states the next may read),
        # while the event loop keeps admitting chunks and answering duplicates.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="hift-batch")
        self.num_batches = 0
        self.device_lost: BaseException | None = None  # set: no batch runs again
        self.on_device_lost: Callable[[BaseException], None] | None = None  # the service's

    def schedule(self) -> BatchPlan | None:
        cfg = self.config
        chunks = self.manager.take_ready(
            cfg.max_batch_sessions,
            urgent_slack_s=cfg.urgent_slack_ms / 1e3,
            urgent_max_frames=cfg.urgent_max_frames,
        )
        return BatchPlan(chunks, self.manager.clock()) if chunks else None

    def update(self, plan: BatchPlan, out: BatchOutput) -> None:
        n = plan.num_slots
        if not (len(out.audio) == len(out.errors) == len(out.fatal) == n):
            # Never guess which answer belongs to whom: fail every slot (invariant 5).
            exc = RuntimeError(f"batch output has {len(out.audio)} slots, the plan {n}")
            out = BatchOutput([None] * n, [exc] * n, [True] * n)
        for i, chunk in enumerate(plan.chunks):
            if isinstance(out.errors[i], RowOutOfMemory):
                out.errors[i] = ResourceExhausted(
                    f"request_id {chunk.request_id!r} seq {chunk.seq}: {out.errors[i]}"
                )
            if out.errors[i] is None:
                samples = out.state_samples[i] if i < len(out.state_samples) else None
                self.manager.complete(
                    chunk,
                    out.audio[i],
                    compute_ms=out.compute_ms,
                    batch_size=n,
                    started_at=plan.started_at,
                    state_samples=samples,
                )
            else:
                self.manager.reject(chunk, out.errors[i], fatal=out.fatal[i])
        self.num_batches += 1
        metrics.BATCH_SESSIONS.observe(n)
        metrics.STEP_SECONDS.observe(out.compute_ms / 1e3)

    async def _wait_for_batch(self) -> None:
        """Until something is ready; then, unless the batch is already full, until the oldest
        ready chunk has waited `max_wait_ms`, so sessions arriving together share a batch."""
        await self.manager.wait_ready()
        if self.config.max_wait_ms <= 0:
            return
        oldest = self.manager.oldest_ready_at()
        if oldest is None or self.manager.num_ready >= self.config.max_batch_sessions:
            return
        remaining = oldest + self.config.max_wait_ms / 1e3 - self.manager.clock()
        if remaining > 0:
            await asyncio.sleep(remaining)

    async def run_batch(self) -> BatchPlan | None:
        plan = self.schedule()
        if plan is None:
            return None
        loop = asyncio.get_running_loop()
        states = [c.session.state for c in plan.chunks]
        mels = [c.mel for c in plan.chunks]
        finalize = [c.finalize for c in plan.chunks]
        try:
            out = await loop.run_in_executor(
                self.executor, self.runner.execute, states, mels, finalize
            )
        except Exception as exc:  # noqa: BLE001 - the runner catches model errors; this is a bug
            n = plan.num_slots
            if is_device_lost(exc):
                lost = Unavailable("this vocoder replica lost its GPU; move the session")
                self.update(plan, BatchOutput([None] * n, [lost] * n, [True] * n))
                self._lose_device(exc)
                return plan
            logger.exception("batch runner crashed")
            out = BatchOutput([None] * n, [exc] * n, [True] * n)
        self.update(plan, out)
        return plan

    def _lose_device(self, exc: BaseException) -> None:
        self.device_lost = exc
        metrics.GPU_FAULTS.labels("device_lost").inc()
        logger.critical("device lost (%s); this replica runs no more batches", exc)
        if self.on_device_lost is not None:
            self.on_device_lost(exc)

    async def run(self) -> None:
        while self.device_lost is None:
            await self._wait_for_batch()
            await self.run_batch()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
