"""The asyncio load generator: streams driven through the gateway's public API
(gateway.client.AsyncClient), closed-loop workers and Poisson open-loop arrivals.

A run is a `LoadPlan`. Its streams go to the plan's gateway addresses round robin (a load
balancer in front of several gateways), and with `procs` > 1 they are driven by that many
processes, each with its own event loop and channels and its share of the streams (a client
population is not one Python event loop): closed loop, the workers dealt out round robin;
open loop, each arrival given to a seeded random process, which splits the one Poisson process
into `procs` independent ones at rate / procs. Which stream is which (voice, tokens, id,
gateway, arrival time) never depends on `procs`. All processes start on one shared instant of
`time.perf_counter()` (CLOCK_MONOTONIC on Linux: one clock for every process of the machine),
so their records merge into one run as if one process had made them.

Tokens go out all at once or at a fixed pace on an absolute clock (a late loop catches up by
sending every token that is due in one message, so the pace never drifts).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import grpc
import numpy as np

from bench.metrics import StreamRecord
from bench.workload import (
    SCHEDULE_KINDS,
    InvalidConfig,
    StreamShape,
    WorkloadConfig,
    chunk_needs,
    make_bench_voice,
    make_tokens,
    poisson_arrivals,
)
from gateway.client import AsyncClient, AsyncStream
from token2wav.tensors import VoiceData
from token2wav.v1 import gateway_pb2


class Progress:
    """One status line on stderr: redrawn in place on a terminal, a line every few seconds
    in a log (the GPU script's output is a log)."""

    def __init__(self, label: str, total: int, enabled: bool = True, every_s: float = 5.0):
        self.label = label
        self.total = total
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.every_s = every_s
        self.started = time.perf_counter()
        self._last = 0.0
        self.done = 0
        self.failed = 0
        self.audio_s = 0.0

    def update(self, rec: StreamRecord) -> None:
        self.count(rec.ok, rec.audio_seconds)

    def count(self, ok: bool, audio_s: float) -> None:
        """One stream finished (in this process or in a load-generator process)."""
        self.done += 1
        self.failed += not ok
        self.audio_s += audio_s
        self._draw(final=False)

    def _draw(self, final: bool) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not (final or self.tty or now - self._last >= self.every_s):
            return
        self._last = now
        elapsed = now - self.started
        width = 24
        filled = int(width * self.done / max(1, self.total))
        line = (
            f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"streams, {self.audio_s:7.1f} audio s in {elapsed:6.1f} s "
            f"(xRT {self.audio_s / max(elapsed, 1e-9):6.1f})"
        )
        if self.failed:
            line += f", {self.failed} failed"
        if self.tty:
            print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self._draw(final=True)


async def _feed(
    stream: AsyncStream, tokens: np.ndarray, pace: float, rec: StreamRecord, burst: int = 1
):
    n = tokens.size
    if pace <= 0:
        await stream.send(tokens)
        now = time.perf_counter()
        rec.token_sent[:] = [now] * n
    else:
        t0 = time.perf_counter()
        i = 0
        while i < n:
            last = min(n, i + burst) - 1  # a burst goes out when its last token is due
            delay = t0 + last / pace - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            j = min(n, max(last + 1, int((now - t0) * pace) + 1))  # everything due by now
            await stream.send(tokens[i:j])
            rec.token_sent[i:j] = [now] * (j - i)
            i = j
    await stream.end()
    rec.end_sent = time.perf_counter()


async def drive_stream(
    client: AsyncClient,
    voice: VoiceData,
    tokens: np.ndarray,
    workload: WorkloadConfig,
    rec: StreamRecord,
    timeout: float | None,
    shape: StreamShape | None = None,
) -> StreamRecord:
    """Run one utterance through the gateway, filling `rec` (created by the caller, so a
    cancelled stream still leaves its record behind); paced as `shape` says, else as
    `workload`."""
    pace, burst = (shape.pace, shape.burst) if shape is not None else (workload.pace, 1)
    rec.token_sent = [0.0] * tokens.size
    rec.opened = time.perf_counter()
    stream = client.stream(
        voice,
        audio_format=workload.audio_format,
        request_id=rec.stream_id,
        timeout=timeout,
        schedule=gateway_pb2.ChunkSchedule(kind=SCHEDULE_KINDS[workload.schedule]),
        start_buffer_ms=workload.start_buffer_ms,
    )
    feeder = asyncio.ensure_future(_feed(stream, tokens, pace, rec, burst))
    try:
        async for chunk in stream:
            t = chunk.timing
            rec.seqs.append(chunk.seq)
            rec.offsets.append(chunk.sample_offset)
            rec.num_samples.append(int(chunk.samples.size))
            rec.arrivals.append(chunk.received_at)
            rec.timings.append(
                (
                    t.flow_queue_ms,
                    t.flow_compute_ms,
                    t.flow_batch_size,
                    t.vocoder_queue_ms,
                    t.vocoder_compute_ms,
                    t.vocoder_batch_size,
                    t.gateway_ms,
                )
            )
            rec.final_seen |= chunk.is_final
        await feeder
    except grpc.aio.AioRpcError as exc:
        rec.status = exc.code().name
        rec.detail = exc.details() or ""
    except asyncio.CancelledError:
        rec.status = "CLIENT_CANCELLED"  # run timeout or drain timeout of the load generator
        stream.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - any load-generator failure is one failed stream
        rec.status = f"CLIENT_{type(exc).__name__}"
        rec.detail = str(exc)
        stream.cancel()
    finally:
        rec.closed = time.perf_counter()
        if not feeder.done():
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
    return rec


def new_record(
    stream_id: str, voice: VoiceData, tokens: np.ndarray, workload: WorkloadConfig
) -> StreamRecord:
    n = int(tokens.size)
    return StreamRecord(
        stream_id, n, chunk_needs(voice.num_prompt_tokens, n, workload.schedule_config)
    )


@dataclass
class LoadResult:
    records: list[StreamRecord]
    window_s: float  # measured window (warm-up excluded)
    t0: float  # perf_counter at the window's start
    warmup_errors: dict[str, int] = field(default_factory=dict)  # status -> streams
    max_in_flight: int = 0
    timed_out: bool = False
    procs: int = 1  # load-generator processes that ran it


@dataclass(frozen=True)
class LoadPlan:
    """One run of the load generator (picklable: the load-generator processes get a copy).

    closed: `level` workers (concurrency), each running `utterances_per_stream` utterances back
    to back; utterance k of worker w is stream w * K + k of the run, whatever the batching mode,
    and goes to gateway (k * level + w) mod N, so each round of utterances is spread evenly.
    Streams still running `timeout_s` after the start are cancelled.
    open: Poisson arrivals at `level` streams/s for `duration_s` s, stream i with its own voice
    to gateway i mod N; arrivals never wait for completions (the load does not back off when
    the stack is slow). Streams still running `timeout_s` after the last arrival are cancelled.
    Warm-up stream i (not measured) goes to gateway i mod N."""

    kind: str  # "closed" | "open"
    targets: tuple[str, ...]  # gateway addresses
    workload: WorkloadConfig
    level: float  # concurrency (closed) or streams/s (open)
    run_id: str
    warmup_streams: int = 0
    stream_timeout_s: float | None = None
    timeout_s: float | None = None  # closed: the run's; open: the drain after the last arrival
    utterances_per_stream: int = 1  # closed
    duration_s: float = 0.0  # open
    procs: int = 1  # load-generator processes

    def __post_init__(self):
        if self.kind not in ("closed", "open"):
            raise InvalidConfig("kind", f"{self.kind!r}, want closed or open")
        if not self.targets:
            raise InvalidConfig("target", "no gateway address")
        if self.procs < 1:
            raise InvalidConfig("client_procs", f"{self.procs}, want >= 1")

    @property
    def concurrency(self) -> int:
        return int(self.level)

    def arrivals(self) -> np.ndarray:
        return poisson_arrivals(self.workload.seed, self.level, self.duration_s)

    def owners(self, n: int) -> np.ndarray:
        """Open loop: the process of each of `n` arrivals. Independent uniform choices: each
        process's arrivals are then a Poisson process of rate / procs."""
        rng = np.random.default_rng([self.workload.seed, 5, self.procs])
        return rng.integers(0, self.procs, n)

    def voice(self, index: int) -> VoiceData:
        return make_bench_voice(self.workload.seed, index, self.workload.prompt_tokens)

    def stream(self, index: int) -> tuple[StreamShape, VoiceData, np.ndarray]:
        """Stream `index` of the run: its shape, voice and tokens (the mixed workload's six
        voices are shared by its streams, as a service's registered voices are)."""
        shape = self.workload.shape(index)
        voice = make_bench_voice(self.workload.seed, shape.voice, shape.prompt_tokens)
        return shape, voice, make_tokens(self.workload.seed, index, shape.utterance_tokens)


@dataclass
class _Part:
    """What one load-generator process measured."""

    records: list[StreamRecord]
    warmup_errors: dict[str, int]
    t0: float  # perf_counter of the run's start (the same instant in every process)
    end: float  # perf_counter when its last stream ended (or was cancelled)
    timed_out: bool


async def _warmup(
    plan: LoadPlan, clients: list[AsyncClient], part: int, num_voices: int
) -> dict[str, int]:
    """This process's share (every procs-th) of `plan.warmup_streams` streams at once, not
    measured: first CUDA kernels, allocator growth, cuDNN plans and the services' voice caches.
    Returns the failures (a broken stack shows up here)."""
    workload = replace(plan.workload, pace=0.0)  # warming kernels needs the shapes, not the wait
    jobs = []
    for i in range(part, plan.warmup_streams, plan.procs):
        if workload.mix == "uniform":
            voice = plan.voice(i % max(1, num_voices))
            tokens = make_tokens(workload.seed, i, workload.utterance_tokens, warmup=True)
        else:
            shape, voice, _ = plan.stream(i)
            tokens = make_tokens(workload.seed, i, shape.utterance_tokens, warmup=True)
        rec = new_record(f"{plan.run_id}-warmup-{i}", voice, tokens, workload)
        jobs.append((_route(plan, clients, i, rec), voice, tokens, rec))
    timeout = plan.stream_timeout_s
    await asyncio.gather(*(drive_stream(c, v, t, workload, r, timeout) for c, v, t, r in jobs))
    errors: dict[str, int] = {}
    for *_, r in jobs:
        if not r.ok:
            errors[r.status] = errors.get(r.status, 0) + 1
    return errors


async def _closed(plan, clients, part, start, on_done, records) -> tuple[float, bool]:
    """(the start, whether the run timed out)"""
    c, k_per = plan.concurrency, plan.utterances_per_stream

    async def worker(w: int) -> None:
        for k in range(k_per):
            idx = w * k_per + k
            if plan.workload.mix == "uniform":  # a worker keeps its voice
                voice, shape = voices[w], None
                tokens = make_tokens(plan.workload.seed, idx, plan.workload.utterance_tokens)
            else:
                shape, voice, tokens = plan.stream(idx)
            rec = new_record(f"{plan.run_id}-{idx}", voice, tokens, plan.workload)
            records.append(rec)
            client = _route(plan, clients, k * c + w, rec)
            await drive_stream(
                client, voice, tokens, plan.workload, rec, plan.stream_timeout_s, shape
            )
            on_done(rec)

    workers = range(part, c, plan.procs)
    voices = {w: plan.voice(w) for w in workers}
    t0 = await start()
    left = None if plan.timeout_s is None else t0 + plan.timeout_s - time.perf_counter()
    try:
        await asyncio.wait_for(
            asyncio.gather(*(worker(w) for w in workers)), None if left is None else max(0.0, left)
        )
    except asyncio.TimeoutError:
        return t0, True
    return t0, False


async def _open(plan, clients, part, start, on_done, records) -> tuple[float, bool]:
    """(the start, whether streams were still running at the end of the drain)"""
    arrivals = plan.arrivals()
    mine = np.flatnonzero(plan.owners(len(arrivals)) == part)
    uniform = plan.workload.mix == "uniform"
    inputs = {
        i: (
            (
                None,
                plan.voice(i),
                make_tokens(plan.workload.seed, i, plan.workload.utterance_tokens),
            )
            if uniform
            else plan.stream(int(i))
        )
        for i in mine
    }

    async def one(i: int) -> None:
        shape, voice, tokens = inputs[i]
        rec = new_record(f"{plan.run_id}-{i}", voice, tokens, plan.workload)
        records.append(rec)
        client = _route(plan, clients, i, rec)
        try:
            await drive_stream(
                client, voice, tokens, plan.workload, rec, plan.stream_timeout_s, shape
            )
        finally:
            on_done(rec)

    t0 = await start()
    tasks = []
    for i in mine:
        await _sleep_until(t0 + float(arrivals[i]))
        tasks.append(asyncio.ensure_future(one(int(i))))
    if not tasks:
        return t0, False
    # the drain counts from the run's last arrival, whichever process has it
    last = t0 + (float(arrivals[-1]) if len(arrivals) else 0.0)
    drain = None if plan.timeout_s is None else max(time.perf_counter(), last) + plan.timeout_s
    _, pending = await asyncio.wait(
        tasks, timeout=None if drain is None else max(0.0, drain - time.perf_counter())
    )
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return t0, bool(pending)


def _route(plan: LoadPlan, clients: list[AsyncClient], n: int, rec: StreamRecord) -> AsyncClient:
    """The n-th stream's gateway, round robin; the record keeps its address."""
    j = n % len(clients)
    rec.target = plan.targets[j]
    return clients[j]


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _drive_part(
    plan: LoadPlan,
    part: int,
    start: Callable[[], Awaitable[float]],
    on_done: Callable[[StreamRecord], None],
) -> _Part:
    """Process `part`'s share of the run: its warm-up streams, then (from the instant `start()`
    returns, once its inputs are made) its measured streams, over one channel per gateway."""
    records: list[StreamRecord] = []
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(AsyncClient(t)) for t in plan.targets]
        num_voices = plan.concurrency if plan.kind == "closed" else len(plan.arrivals())
        warm = await _warmup(plan, clients, part, num_voices)
        run = _closed if plan.kind == "closed" else _open
        t0, timed_out = await run(plan, clients, part, start, on_done, records)
        end = time.perf_counter()
    return _Part(records, warm, t0, end, timed_out)


def peak_in_flight(records: list[StreamRecord]) -> int:
    """The most streams open at once (each from `opened` to `closed`)."""
    events = sorted(
        [(r.opened, 1) for r in records if r.opened] + [(r.closed, -1) for r in records if r.closed]
    )  # at a tie the close (-1) sorts first
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def _merge(plan: LoadPlan, parts: list[_Part]) -> LoadResult:
    t0 = parts[0].t0
    records = [r for part in parts for r in part.records]
    if len(parts) > 1:
        records.sort(key=lambda r: r.opened)  # the order one process would have opened them
    warm: dict[str, int] = {}
    for part in parts:
        for status, n in part.warmup_errors.items():
            warm[status] = warm.get(status, 0) + n
    end = max(part.end for part in parts)
    timed_out = any(part.timed_out for part in parts)
    peak = peak_in_flight(records)
    if plan.kind == "closed":  # the window: the workers' start to the last completion
        return LoadResult(records, end - t0, t0, warm, peak, timed_out, len(parts))
    # open loop: the first arrival to the last completion
    arrivals = plan.arrivals()
    first = t0 + (float(arrivals[0]) if len(arrivals) else 0.0)
    ends = [r.arrivals[-1] for r in records if r.arrivals]
    window = (max(ends) if ends else end) - first
    return LoadResult(records, window, first, warm, peak, timed_out, len(parts))


class LoadgenError(RuntimeError):
    """A load-generator process failed (not a stream: the process itself)."""


START_LEAD_S = 0.05  # the shared start is this far after the go, so every process sees it first


def run_load(plan: LoadPlan, progress: Progress) -> LoadResult:
    """Run `plan` (blocking): in this process, or with `plan.procs` > 1 in that many
    load-generator processes started for the run (their warm-ups first, then one shared start)."""
    if plan.kind == "closed" and plan.procs > plan.concurrency:
        plan = replace(plan, procs=max(1, plan.concurrency))  # a process per worker at most
    if plan.procs == 1:

        async def now() -> float:
            return time.perf_counter()

        parts = [asyncio.run(_drive_part(plan, 0, now, progress.update))]
    else:
        parts = _run_procs(plan, progress)
    progress.close()
    return _merge(plan, parts)


def _run_procs(plan: LoadPlan, progress: Progress) -> list[_Part]:
    # spawn, not fork: this process may hold gRPC channels and threads, which a fork breaks
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    go = ctx.Event()
    start = ctx.Value("d", 0.0)
    procs = [
        ctx.Process(
            target=_child,
            args=(plan, p, messages, go, start, os.getpid()),
            name=f"loadgen-{p}",
            daemon=True,
        )
        for p in range(plan.procs)
    ]
    parts: dict[int, _Part] = {}
    ready: set[int] = set()
    finished = False
    try:
        for proc in procs:
            proc.start()
        suspects: set[int] = set()  # exited without a result at the last empty wait
        while len(parts) < len(procs):
            try:
                msg = messages.get(timeout=1.0)
            except queue.Empty:
                dead = {p for p, proc in enumerate(procs) if not proc.is_alive()} - set(parts)
                if dead & suspects:  # dead for two waits: its result is not in the queue
                    p = min(dead & suspects)
                    raise LoadgenError(
                        f"load-generator process {p} exited with {procs[p].exitcode} "
                        "without its streams' records"
                    ) from None
                suspects = dead
                continue
            kind, p, *rest = msg
            if kind == "ready":
                ready.add(p)
                if len(ready) == len(procs):  # every warm-up done: one start for all
                    start.value = time.perf_counter() + START_LEAD_S
                    go.set()
            elif kind == "done":
                progress.count(*rest)
            elif kind == "part":
                parts[p] = rest[0]
            else:
                raise LoadgenError(f"load-generator process {p} failed:\n{rest[0]}")
        finished = True
    finally:
        for proc in procs:
            if proc.pid is None:
                continue  # never started
            if not finished:  # an error, Ctrl-C or SIGTERM here: the others' streams go too
                proc.terminate()
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
    return [parts[p] for p in range(len(procs))]


def _child(plan: LoadPlan, part: int, messages, go, start, parent: int) -> None:
    """A load-generator process: its warm-up, "ready", the shared start, its streams, then its
    records back to the parent (a stream's progress as it ends)."""

    async def wait_for_start() -> float:
        messages.put(("ready", part))
        while not await asyncio.to_thread(go.wait, 1.0):
            if os.getppid() != parent:  # the parent is gone: nobody will say go
                raise LoadgenError("parent process exited")
        await _sleep_until(start.value)
        return start.value

    def done(rec: StreamRecord) -> None:
        messages.put(("done", part, rec.ok, rec.audio_seconds))

    try:
        messages.put(("part", part, asyncio.run(_drive_part(plan, part, wait_for_start, done))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        messages.put(("error", part, traceback.format_exc()))
