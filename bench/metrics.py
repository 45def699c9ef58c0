"""What one stream recorded, and the figures of a run computed from those records.

Pure functions over plain data (no gRPC, no clock), so the smoke test and the unit tests can
check them on hand-made records. Every time is `time.perf_counter()` seconds in the load
generator's processes (CLOCK_MONOTONIC on Linux: one clock for all of them, so records made by
several processes compare); the per-chunk `timing` fields are the services' own milliseconds.

Definitions (docs/BENCHMARKS.md explains them at more length):
  first-chunk latency   first audio arrival - the moment the first chunk's tokens (first hop +
                        lookahead, or all of them with the end of input) had all been sent
  chunk latency         the same for every chunk k, against chunk k's tokens
  inter-chunk gap       arrival of chunk k - arrival of chunk k-1, pooled over streams
  end-to-end            stream opened -> final chunk arrived
  xRT                   audio seconds of completed streams / wall seconds of the window
  underrun              playback starts when chunk 0 arrives, with no extra buffer; chunk k
                        underruns when it arrives after everything before it has played
  excess buffer         the start delay a player would need to never stall, minus the one the
                        token input alone forces (see simulate_playback)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from token2wav import SAMPLE_RATE, SAMPLES_PER_TOKEN

TIMING_FIELDS = (
    "flow_queue_ms",
    "flow_compute_ms",
    "flow_batch_size",
    "vocoder_queue_ms",
    "vocoder_compute_ms",
    "vocoder_batch_size",
    "gateway_ms",
)
_FQ, _FC, _FB, _VQ, _VC, _VB, _GW = range(len(TIMING_FIELDS))


@dataclass
class StreamRecord:
    stream_id: str
    num_tokens: int
    needs: list[int | None]  # [num_planned_chunks] tokens sent before chunk k can go, None: end
    opened: float = 0.0  # the Synthesize call was made
    token_sent: list[float] = field(default_factory=list)  # [num_tokens] when each was sent
    end_sent: float = 0.0  # EndOfInput sent
    seqs: list[int] = field(default_factory=list)  # [num_chunks] as received
    offsets: list[int] = field(default_factory=list)  # [num_chunks] sample_offset
    num_samples: list[int] = field(default_factory=list)  # [num_chunks]
    arrivals: list[float] = field(default_factory=list)  # [num_chunks]
    timings: list[tuple[float, ...]] = field(default_factory=list)  # [num_chunks] TIMING_FIELDS
    final_seen: bool = False
    closed: float = 0.0  # the stream ended (last chunk, or its error) as the client saw it
    status: str = "OK"  # a grpc.StatusCode name, or CLIENT_<exception> for a load-generator error
    detail: str = ""
    target: str = ""  # the gateway address the stream went to

    # -- derived ----------------------------------------------------------------------------
    def ready_at(self, seq: int) -> float:
        """When chunk `seq`'s tokens had all been sent (the zero of its latency)."""
        need = self.needs[seq] if seq < len(self.needs) else None
        return self.end_sent if need is None else self.token_sent[need - 1]

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def audio_seconds(self) -> float:
        return sum(self.num_samples) / SAMPLE_RATE

    def problems(self) -> list[str]:
        """Broken delivery promises (invariant 4), empty when the stream is consistent."""
        out = []
        if self.seqs != list(range(len(self.seqs))):
            out.append(f"seqs {self.seqs[:8]}... not 0, 1, 2, ...")
        pos = 0
        for seq, off, n in zip(self.seqs, self.offsets, self.num_samples):
            if off != pos:
                out.append(f"chunk {seq}: sample_offset {off}, want {pos}")
                break
            pos += n
        if pos != SAMPLES_PER_TOKEN * self.num_tokens:
            out.append(f"{pos} samples, want {SAMPLES_PER_TOKEN} x {self.num_tokens} tokens")
        if len(self.seqs) != len(self.needs):
            out.append(f"{len(self.seqs)} chunks, the schedule plans {len(self.needs)}")
        if not self.final_seen:
            out.append("no is_final chunk")
        return out


STACK_TOLERANCE_S = 0.02  # one mel frame: less extra buffer than a player's own output buffer


@dataclass(frozen=True)
class Playback:
    underruns: int  # chunks that arrived after the audio before them had played out
    stall_s: float  # silence heard in total (the player pauses, then resumes)
    buffer_s: float  # start delay after chunk 0 that would have avoided every stall
    input_buffer_s: float  # the same for a stack that answers the moment tokens are in

    @property
    def excess_buffer_s(self) -> float:
        """The buffer the stack itself makes necessary, beyond what the token input forces."""
        return max(0.0, self.buffer_s - self.input_buffer_s)


def _buffer_needed(starts: list[float], offsets_s: list[float]) -> float:
    """Smallest D such that chunk k is there by starts[0] + D + (audio before it)."""
    return max(0.0, max(t - starts[0] - off for t, off in zip(starts, offsets_s)))


def simulate_playback(rec: StreamRecord) -> Playback:
    """A player that starts the moment chunk 0 arrives and pauses whenever it runs dry.

    With tokens fed at the speed of speech (25/s) stalls are unavoidable whatever the back end:
    the hop doubles (25, 50, 100 tokens), so chunk k+1's tokens take twice as long to arrive
    as chunk k's audio takes to play. `input_buffer_s` measures that floor (the buffer an
    infinitely fast stack would still need) and `excess_buffer_s` what the stack adds to it.
    """
    if not rec.arrivals:
        return Playback(0, 0.0, 0.0, 0.0)
    played_to = rec.arrivals[0] + rec.num_samples[0] / SAMPLE_RATE
    underruns = 0
    stall = 0.0
    for k in range(1, len(rec.arrivals)):
        if rec.arrivals[k] > played_to:
            underruns += 1
            stall += rec.arrivals[k] - played_to
            played_to = rec.arrivals[k]
        played_to += rec.num_samples[k] / SAMPLE_RATE
    offsets_s = [off / SAMPLE_RATE for off in rec.offsets]
    ready = [rec.ready_at(seq) for seq in rec.seqs]
    return Playback(
        underruns,
        stall,
        _buffer_needed(rec.arrivals, offsets_s),
        _buffer_needed(ready, offsets_s),
    )


def excess_buffer_ms(
    arrivals_ms: list[float],
    latency_ms: list[float],
    samples: list[int],
    floors_ms: list[float] | None = None,
) -> float:
    """A stream's excess buffer (ms) from its per-chunk line (`stream_summary`), allowing each
    chunk k the compute an idle stack needs for it: `floors_ms[k]`, its tokens-in -> audio-out
    latency with the stack otherwise idle (bench capacity measures it per token pace). The
    input-forced schedule is then "chunk k out floors[k] after its tokens", not "at once":
    where the token input leaves no slack (50 tokens/s: chunk k+1's tokens complete exactly
    when chunk k's audio runs out), chunk k+1 arrives floors[k+1] - floors[0] later than the
    player needs it on any stack, and that stall is not the stack's to answer for. Without
    floors: exactly `simulate_playback`'s figure."""
    if not arrivals_ms:
        return 0.0
    floors = list(floors_ms or [])
    floors += [floors[-1] if floors else 0.0] * (len(arrivals_ms) - len(floors))
    offsets = np.concatenate([[0.0], np.cumsum(samples[:-1])]) / SAMPLE_RATE * 1e3
    ready = [a - lat + f for a, lat, f in zip(arrivals_ms, latency_ms, floors)]
    buffer = max(0.0, max(a - arrivals_ms[0] - o for a, o in zip(arrivals_ms, offsets)))
    forced = max(0.0, max(r - ready[0] - o for r, o in zip(ready, offsets)))
    return max(0.0, buffer - forced)


def stall_chunk(stream: dict) -> int | None:
    """The chunk that sets a stream's needed start buffer (`stream_summary`'s line): the one
    that arrives latest against when the player reaches it, had it started at chunk 0."""
    arrivals = stream.get("chunk_arrivals_ms")
    if not arrivals:
        return None
    offsets = np.concatenate([[0.0], np.cumsum(stream["chunk_samples"][:-1])]) / SAMPLE_RATE
    return int(np.argmax(np.asarray(arrivals) - arrivals[0] - offsets * 1e3))


def stall_post_mortem(streams: list[dict]) -> dict | None:
    """For stalled streams' lines: where the chunk that sets each stall spent its time,
    medians over the streams, beside the same stream's first chunk (with the token input
    leaving no slack, a later chunk may take at most 20 ms longer than the first)."""
    rows = []
    for s in streams:
        k = stall_chunk(s)
        timing = s.get("chunk_timing_ms")
        if k is None or not timing or k >= len(timing):
            continue
        lat = s["chunk_latency_ms"]
        rows.append((k, len(lat), lat[k], lat[0], *timing[k]))
    if not rows:
        return None
    t = np.asarray(rows, np.float64)
    med = lambda col: float(np.median(t[:, col]))  # noqa: E731
    seqs: dict[str, int] = {}
    for k, n in t[:, :2].astype(int):
        key = "final" if k == n - 1 else str(k)
        seqs[key] = seqs.get(key, 0) + 1
    fields = dict(zip(TIMING_FIELDS, range(4, 4 + len(TIMING_FIELDS))))
    return {
        "streams": len(rows),
        "chunk": dict(sorted(seqs.items())),
        "latency_ms": med(2),
        "first_chunk_latency_ms": med(3),
        **{name: med(col) for name, col in fields.items()},
    }


def percentiles(values) -> dict | None:
    """p50/p95/p99/mean/max/n; linear interpolation keeps p50 <= p95 <= p99 <= max."""
    arr = np.asarray(values, np.float64)
    if arr.size == 0:
        return None
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {
        "p50": float(p50),
        "p95": float(p95),
        "p99": float(p99),
        "mean": float(arr.mean()),
        "max": float(arr.max()),
        "n": int(arr.size),
    }


def _stages(rows: list[tuple[float, ...]], client_ms: list[float]) -> dict | None:
    """Mean ms per chunk in each stage; `gateway` is what the gateway's own clock adds on top
    of the services (routing, ordering), `wire` what the client sees beyond the gateway."""
    if not rows:
        return None
    t = np.asarray(rows, np.float64)
    services = t[:, _FQ] + t[:, _FC] + t[:, _VQ] + t[:, _VC]
    return {
        "flow_queue_ms": float(t[:, _FQ].mean()),
        "flow_compute_ms": float(t[:, _FC].mean()),
        "vocoder_queue_ms": float(t[:, _VQ].mean()),
        "vocoder_compute_ms": float(t[:, _VC].mean()),
        "gateway_ms": float((t[:, _GW] - services).mean()),
        "wire_ms": float((np.asarray(client_ms) - t[:, _GW]).mean()),
        "flow_batch_size": float(t[:, _FB].mean()),
        "vocoder_batch_size": float(t[:, _VB].mean()),
    }


def summarize(records: list[StreamRecord], window_s: float) -> dict:
    """The figures of one run (one concurrency level or one arrival rate)."""
    errors: dict[str, int] = {}  # status name -> streams
    inconsistent: dict[str, list[str]] = {}  # stream id -> problems
    ok = []
    for r in records:
        status = r.status
        if r.ok and (probs := r.problems()):
            inconsistent[r.stream_id] = probs
            status = "INCONSISTENT"  # a clean status with broken audio counts as a failure
        if status == "OK":
            ok.append(r)
        else:
            errors[status] = errors.get(status, 0) + 1
    first, gaps, e2e, after_end, chunk_ms = [], [], [], [], []
    rows, first_rows, first_client = [], [], []
    playbacks = []
    for r in ok:
        lat = [(a - r.ready_at(s)) * 1e3 for s, a in zip(r.seqs, r.arrivals)]
        first.append(lat[0])
        chunk_ms.extend(lat)
        gaps.extend(np.diff(r.arrivals) * 1e3)
        e2e.append((r.arrivals[-1] - r.opened) * 1e3)
        after_end.append((r.arrivals[-1] - r.end_sent) * 1e3)
        rows.extend(r.timings)
        first_rows.append(r.timings[0])
        first_client.append(lat[0])
        playbacks.append(simulate_playback(r))
    audio_s = sum(r.audio_seconds for r in ok)
    num = len(records)
    return {
        "num_streams": num,
        "num_ok": len(ok),
        "completion_rate": len(ok) / num if num else None,
        "errors": errors,
        "error_rate": (num - len(ok)) / num if num else None,
        "inconsistent_streams": inconsistent,
        "window_s": window_s,
        "audio_s": audio_s,
        "tokens": sum(r.num_tokens for r in ok),
        "chunks": sum(len(r.seqs) for r in ok),
        "xrt": audio_s / window_s if window_s > 0 else None,
        "first_chunk_ms": percentiles(first),
        "chunk_latency_ms": percentiles(chunk_ms),
        "inter_chunk_gap_ms": percentiles(gaps),
        "e2e_ms": percentiles(e2e),
        "final_after_end_ms": percentiles(after_end),
        "underruns": {
            "streams": sum(p.underruns > 0 for p in playbacks),
            "events": sum(p.underruns for p in playbacks),
            "stall_s": sum(p.stall_s for p in playbacks),
            # streams that would stall even with the buffer the token input itself needs
            "stack_streams": sum(p.excess_buffer_s > STACK_TOLERANCE_S for p in playbacks),
            "buffer_ms": percentiles([p.buffer_s * 1e3 for p in playbacks]),
            "input_buffer_ms": percentiles([p.input_buffer_s * 1e3 for p in playbacks]),
            "excess_buffer_ms": percentiles([p.excess_buffer_s * 1e3 for p in playbacks]),
        },
        "stages": _stages(rows, chunk_ms),
        "first_chunk_stages": _stages(first_rows, first_client),
    }


def stream_summary(rec: StreamRecord, t0: float) -> dict:
    """The per-stream line kept in the run JSON (for CDFs and post-mortems)."""
    out = {
        "id": rec.stream_id,
        "status": rec.status,
        "tokens": rec.num_tokens,
        "chunks": len(rec.seqs),
        "audio_s": rec.audio_seconds,
    }
    if rec.target:
        out["target"] = rec.target
    if rec.detail:
        out["detail"] = rec.detail[:300]
    if rec.closed:
        out["closed_ms"] = (rec.closed - rec.opened) * 1e3  # e.g. how fast a refusal came
    if rec.arrivals:
        out["first_chunk_ms"] = (rec.arrivals[0] - rec.ready_at(rec.seqs[0])) * 1e3
        out["e2e_ms"] = (rec.arrivals[-1] - rec.opened) * 1e3
        out["start_s"] = rec.opened - t0  # from the start of the run's window
        out["chunk_arrivals_ms"] = [round((a - rec.opened) * 1e3, 3) for a in rec.arrivals]
        # tokens in -> audio out per chunk (arrivals minus this give when each chunk's tokens
        # were all sent; bench capacity recomputes the excess with compute floors from these)
        out["chunk_latency_ms"] = [
            round((a - rec.ready_at(seq)) * 1e3, 3) for seq, a in zip(rec.seqs, rec.arrivals)
        ]
        out["chunk_samples"] = list(rec.num_samples)
        out["chunk_timing_ms"] = [[round(x, 2) for x in t] for t in rec.timings]  # TIMING_FIELDS
        pb = simulate_playback(rec)
        out["underruns"] = pb.underruns
        out["stall_s"] = pb.stall_s
        out["excess_buffer_ms"] = pb.excess_buffer_s * 1e3
    return out
