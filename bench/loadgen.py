"""The asyncio load generator: streams driven through the gateway's public API
(gateway.client.AsyncClient), closed-loop workers and Poisson open-loop arrivals.

One process, one event loop, one channel: what an LLM server in front of the gateway would do.
Tokens go out all at once or at a fixed pace on an absolute clock (a late loop catches up by
sending every token that is due in one message, so the pace never drifts).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field, replace

import grpc
import numpy as np

from bench.metrics import StreamRecord
from bench.workload import (
    WorkloadConfig,
    chunk_needs,
    make_bench_voice,
    make_tokens,
    poisson_arrivals,
)
from gateway.client import AsyncClient, AsyncStream
from token2wav.tensors import VoiceData


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
        self.done += 1
        self.failed += not rec.ok
        self.audio_s += rec.audio_seconds
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


async def _feed(stream: AsyncStream, tokens: np.ndarray, pace: float, rec: StreamRecord):
    n = tokens.size
    if pace <= 0:
        await stream.send(tokens)
        now = time.perf_counter()
        rec.token_sent[:] = [now] * n
    else:
        t0 = time.perf_counter()
        i = 0
        while i < n:
            delay = t0 + i / pace - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            j = min(n, max(i + 1, int((now - t0) * pace) + 1))  # everything due by now
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
) -> StreamRecord:
    """Run one utterance through the gateway, filling `rec` (created by the caller, so a
    cancelled stream still leaves its record behind)."""
    rec.token_sent = [0.0] * tokens.size
    rec.opened = time.perf_counter()
    stream = client.stream(
        voice, audio_format=workload.audio_format, request_id=rec.stream_id, timeout=timeout
    )
    feeder = asyncio.ensure_future(_feed(stream, tokens, workload.pace, rec))
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


def new_record(stream_id: str, voice: VoiceData, tokens: np.ndarray) -> StreamRecord:
    return StreamRecord(
        stream_id, int(tokens.size), chunk_needs(voice.num_prompt_tokens, int(tokens.size))
    )


@dataclass
class LoadResult:
    records: list[StreamRecord]
    window_s: float  # measured window (warm-up excluded)
    t0: float  # perf_counter at the window's start
    warmup_errors: dict[str, int] = field(default_factory=dict)  # status -> streams
    max_in_flight: int = 0
    timed_out: bool = False


async def _warmup(
    client: AsyncClient,
    workload: WorkloadConfig,
    voices: list[VoiceData],
    num: int,
    timeout,
    run_id: str,
) -> dict[str, int]:
    """`num` streams at once, not measured: first CUDA kernels, allocator growth, cuDNN plans
    and the services' voice caches. Returns the failures (a broken stack shows up here)."""
    workload = replace(workload, pace=0.0)  # warming kernels needs the shapes, not the wait
    jobs = []
    for i in range(num):
        voice = voices[i % len(voices)]
        tokens = make_tokens(workload.seed, i, workload.utterance_tokens, warmup=True)
        jobs.append((voice, tokens, new_record(f"{run_id}-warmup-{i}", voice, tokens)))
    await asyncio.gather(*(drive_stream(client, v, t, workload, r, timeout) for v, t, r in jobs))
    recs = [r for _, _, r in jobs]
    errors: dict[str, int] = {}
    for r in recs:
        if not r.ok:
            errors[r.status] = errors.get(r.status, 0) + 1
    return errors


async def closed_loop(
    target: str,
    workload: WorkloadConfig,
    concurrency: int,
    utterances_per_stream: int,
    warmup_streams: int,
    stream_timeout: float | None,
    run_timeout: float | None,
    progress: Progress,
    run_id: str,
) -> LoadResult:
    """`concurrency` workers, each running `utterances_per_stream` utterances back to back.
    Utterance k of worker w is stream w * K + k of the run, whatever the batching mode."""
    k_per = utterances_per_stream
    voices = [
        make_bench_voice(workload.seed, w, workload.prompt_tokens) for w in range(concurrency)
    ]
    records: list[StreamRecord] = []
    async with AsyncClient(target) as client:
        warm = await _warmup(client, workload, voices, warmup_streams, stream_timeout, run_id)
        in_flight = 0
        peak = 0

        async def worker(w: int) -> None:
            nonlocal in_flight, peak
            for k in range(k_per):
                idx = w * k_per + k
                tokens = make_tokens(workload.seed, idx, workload.utterance_tokens)
                rec = new_record(f"{run_id}-{idx}", voices[w], tokens)
                records.append(rec)
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    await drive_stream(client, voices[w], tokens, workload, rec, stream_timeout)
                finally:
                    in_flight -= 1
                progress.update(rec)

        t0 = time.perf_counter()
        timed_out = False
        try:
            await asyncio.wait_for(
                asyncio.gather(*(worker(w) for w in range(concurrency))), run_timeout
            )
        except asyncio.TimeoutError:
            timed_out = True
        window = time.perf_counter() - t0
    progress.close()
    return LoadResult(records, window, t0, warm, peak, timed_out)


async def open_loop(
    target: str,
    workload: WorkloadConfig,
    rate: float,
    duration: float,
    warmup_streams: int,
    stream_timeout: float | None,
    drain_timeout: float,
    progress: Progress,
    run_id: str,
) -> LoadResult:
    """Poisson arrivals at `rate` streams/s for `duration` s, each stream with its own voice;
    arrivals never wait for completions (the load does not back off when the stack is slow).
    The window runs from the first arrival to the last completion."""
    arrivals = poisson_arrivals(workload.seed, rate, duration)
    voices = [
        make_bench_voice(workload.seed, i, workload.prompt_tokens) for i in range(len(arrivals))
    ]
    token_lists = [
        make_tokens(workload.seed, i, workload.utterance_tokens) for i in range(len(arrivals))
    ]
    records: list[StreamRecord] = []
    tasks: list[asyncio.Task] = []
    in_flight = 0
    peak = 0
    async with AsyncClient(target) as client:
        spare = [make_bench_voice(workload.seed, 0, workload.prompt_tokens)]
        warm = await _warmup(
            client, workload, voices or spare, warmup_streams, stream_timeout, run_id
        )

        async def one(i: int) -> None:
            nonlocal in_flight, peak
            rec = new_record(f"{run_id}-{i}", voices[i], token_lists[i])
            records.append(rec)
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await drive_stream(client, voices[i], token_lists[i], workload, rec, stream_timeout)
            finally:
                in_flight -= 1
                progress.update(rec)

        t0 = time.perf_counter()
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i)))
        timed_out = False
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout)
            if pending:
                timed_out = True
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        first = t0 + (float(arrivals[0]) if len(arrivals) else 0.0)
        ends = [r.arrivals[-1] for r in records if r.arrivals]
        window = (max(ends) if ends else time.perf_counter()) - first
    progress.close()
    return LoadResult(records, window, first, warm, peak, timed_out)
