"""A sweep: which runs to make (the plan), making them against one or two stacks, and the
time budget that keeps a GPU session inside its limit.

Batching on and off are measured in the same invocation against two stacks that stay up side by
side, alternating per level in ABBA order (on, off at one level; off, on at the next), so slow
drift (clocks, thermals, allocator growth) does not favour one mode. Both modes see the same
streams: stream i of a level has the same voice and tokens whatever the mode.
"""

from __future__ import annotations

import datetime as dt
import math
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.gpu import GpuMemorySampler
from bench.loadgen import LoadPlan, Progress, run_load
from bench.metrics import stream_summary, summarize
from bench.report import SCHEMA, write_results, write_run
from bench.stack import Stack
from bench.workload import TOKEN_RATE, InvalidConfig, WorkloadConfig


@dataclass(frozen=True)
class RunSpec:
    kind: str  # "closed" | "open"
    label: str  # "on" | "off", or the --label of an external gateway
    level: float  # concurrency (closed) or arrivals per second (open)
    pace: float  # tokens/s per stream; 0: all at once
    utterances_per_stream: int = 1  # closed loop
    duration_s: float = 0.0  # open loop
    start_buffer_ms: int | None = None  # every stream's StreamConfig.start_buffer_ms

    def describe(self) -> str:
        what = f"{int(self.level)} streams" if self.kind == "closed" else f"{self.level:g}/s"
        pace = f", {self.pace:g} tok/s" if self.pace > 0 else ""
        sb = "" if self.start_buffer_ms is None else f", start buffer {self.start_buffer_ms} ms"
        return f"{self.kind} {what}{pace}{sb}, batching {self.label}"


@dataclass(frozen=True)
class SweepConfig:
    labels: tuple[str, ...] = ("on", "off")
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    off_concurrency: tuple[int, ...] | None = None  # levels measured with batching off; None: all
    utterances_per_stream: int = 2
    max_utterances_per_level: int = 0  # caps C x K (K >= 1 always); 0: no cap
    paced_concurrency: tuple[int, ...] = ()  # extra closed-loop levels with tokens at a pace
    paced_rate: float = 25.0  # tokens/s of those runs (25: as fast as the audio plays)
    rates: tuple[float, ...] = ()  # Poisson arrivals, streams/s
    off_rates: tuple[float, ...] | None = None
    duration_s: float = 30.0  # Poisson arrival window
    warmup_streams: int = 4  # per run, not measured (at most the concurrency in closed loop)
    stream_timeout_s: float = 600.0  # gRPC deadline of each stream
    run_timeout_s: float = 600.0  # closed loop: streams still running then are cancelled
    drain_timeout_s: float = 120.0  # open loop: wait this long after the last arrival
    time_budget_s: float = 0.0  # skip runs whose estimate would overrun it; 0: no budget
    client_procs: int = 1  # load-generator processes, each with its share of every run's streams
    # Each level runs once per start buffer (StreamConfig.start_buffer_ms; None: unset), on the
    # same stack: an A/B of buffers costs no second stack start.
    start_buffers: tuple[int | None, ...] = (None,)

    def __post_init__(self):
        if not self.labels:
            raise InvalidConfig("batching", "empty; want on, off or on,off")
        for c in (*self.concurrency, *self.paced_concurrency):
            if not 1 <= c <= 4096:
                raise InvalidConfig("concurrency", f"{c}, want 1..4096")
        if self.utterances_per_stream < 1:
            raise InvalidConfig("utterances_per_stream", f"{self.utterances_per_stream}, want >= 1")
        if self.paced_concurrency and self.paced_rate <= 0:
            raise InvalidConfig("paced_rate", f"{self.paced_rate}, want > 0 tokens/s")
        for field, rates in (("rates", self.rates), ("off_rates", self.off_rates or ())):
            if any(r <= 0 for r in rates):
                raise InvalidConfig(field, f"{rates}, want arrival rates > 0 streams/s")
        if self.rates and self.duration_s <= 0:
            raise InvalidConfig("duration", f"{self.duration_s}, want > 0 s")
        if self.warmup_streams < 0:
            raise InvalidConfig("warmup_streams", f"{self.warmup_streams}, want >= 0")
        if self.client_procs < 1:
            raise InvalidConfig("client_procs", f"{self.client_procs}, want >= 1")
        if not self.start_buffers:
            raise InvalidConfig("start_buffer_ms", "empty; want ms values, e.g. 0,200")
        for ms in self.start_buffers:
            WorkloadConfig(start_buffer_ms=ms)  # its bounds, before any stack starts

    def utterances_at(self, concurrency: int) -> int:
        k = self.utterances_per_stream
        if self.max_utterances_per_level:
            k = min(k, self.max_utterances_per_level // concurrency)
        return max(1, k)


def plan(cfg: SweepConfig, pace: float) -> list[RunSpec]:
    specs: list[RunSpec] = []

    def add(kind, levels, allowed_off, run_pace, **kw):
        for i, level in enumerate(levels):
            order = cfg.labels if i % 2 == 0 else tuple(reversed(cfg.labels))  # ABBA
            buffers = cfg.start_buffers if i % 2 == 0 else tuple(reversed(cfg.start_buffers))
            for label in order:
                if label == "off" and allowed_off is not None and level not in allowed_off:
                    continue
                if kind == "closed":
                    kw["utterances_per_stream"] = cfg.utterances_at(int(level))
                for ms in buffers:
                    specs.append(RunSpec(kind, label, level, run_pace, start_buffer_ms=ms, **kw))

    add("closed", cfg.concurrency, cfg.off_concurrency, pace)
    # A paced level equal to a main level (same concurrency, same pace) would only repeat it
    # under the same run name, overwriting its JSON.
    same = cfg.paced_rate == pace
    paced = tuple(c for c in cfg.paced_concurrency if not (same and c in cfg.concurrency))
    add("closed", paced, cfg.off_concurrency, cfg.paced_rate)
    add("open", cfg.rates, cfg.off_rates, pace, duration_s=cfg.duration_s)
    return specs


def estimate_s(spec: RunSpec, workload: WorkloadConfig, cfg: SweepConfig, done: list[dict]):
    """Seconds the run will likely take, None when nothing comparable ran yet (then it just
    runs). xRT at the new level is extrapolated on log-log axes from the two highest lower
    levels measured in the same mode (slope clipped to 0..1: throughput neither falls with
    load nor grows faster than it); from one level, batching on is assumed to scale linearly
    (optimistic: a run is skipped only when it clearly cannot fit) and anything else flat."""
    utt_s = workload.utterance_tokens / TOKEN_RATE
    if spec.kind == "open":
        return spec.duration_s + 2 * utt_s
    pts = sorted(
        (r["concurrency"], r["metrics"]["xrt"])
        for r in done
        if r["label"] == spec.label
        and r["kind"] == "closed"
        and r["workload"]["pace"] == 0  # paced runs' xRT is bounded by the input
        and r["metrics"]["xrt"]
        and r["concurrency"] <= spec.level
    )
    input_s = spec.utterances_per_stream * workload.utterance_tokens / spec.pace if spec.pace else 0
    if not pts:
        return input_s or None
    c1, x1 = pts[-1]
    slope = 1.0 if spec.label == "on" else 0.0
    if len(pts) >= 2 and pts[-2][0] < c1:
        c0, x0 = pts[-2]
        slope = min(1.0, max(0.0, math.log(x1 / x0) / math.log(c1 / c0)))
    xrt = x1 * (spec.level / c1) ** slope
    n = int(spec.level) * spec.utterances_per_stream + min(cfg.warmup_streams, int(spec.level))
    return max(input_s, 1.1 * n * utt_s / xrt)


@dataclass
class Target:
    """Where a label's load goes: the gateways of a stack we started, or external gateways;
    the streams of a run are spread over `addresses` round robin."""

    addresses: list[str]
    stack: Stack | None = None

    @property
    def address(self) -> str:
        return ",".join(self.addresses)


class Sweep:
    def __init__(
        self,
        cfg: SweepConfig,
        workload: WorkloadConfig,
        targets: dict[str, Target],  # label -> target
        out_dir: Path,
        env: dict,
        meta: dict,  # dtype, preset, device (what the stacks run)
        quiet: bool = False,
    ):
        self.cfg = cfg
        self.workload = workload
        self.targets = targets
        self.out_dir = out_dir
        self.env = env
        self.meta = meta
        self.quiet = quiet
        self.runs: list[dict] = []
        self.skipped: list[str] = []
        self.sampler = GpuMemorySampler().start()
        self.nonce = uuid.uuid4().hex[:6]  # this invocation
        self.num_started = 0

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def run_all(self, specs: list[RunSpec]) -> list[dict]:
        started = time.monotonic()
        try:
            for i, spec in enumerate(specs):
                est = estimate_s(spec, self.workload, self.cfg, self.runs)
                left = self.cfg.time_budget_s - (time.monotonic() - started)
                if self.cfg.time_budget_s and est is not None and est > left:
                    why = (
                        f"{self.meta['dtype']} {spec.describe()}: about {est:.0f} s, "
                        f"{max(left, 0):.0f} s of budget left"
                    )
                    self.skipped.append(why)
                    self.log(f"[{i + 1}/{len(specs)}] skipped {why}")
                    continue
                self.log(
                    f"[{i + 1}/{len(specs)}] {spec.describe()}"
                    + (f" (~{est:.0f} s)" if est else "")
                )
                # With a budget, a run that overruns its estimate is cut off (cancelled
                # streams are reported as such) rather than eating the next runs' time.
                limit = self.cfg.run_timeout_s
                if self.cfg.time_budget_s:
                    limit = min(limit, max(30.0, left))
                run = self.run_one(spec, limit)
                self.runs.append(run)
                write_run(self.out_dir, run)
                write_results(self.out_dir, self.env, self.runs, self.skipped)
                self.log("    " + one_line(run))
        finally:
            self.sampler.stop()
            write_results(self.out_dir, self.env, self.runs, self.skipped)
        return self.runs

    def run_one(self, spec: RunSpec, run_timeout_s: float) -> dict:
        target = self.targets[spec.label]
        if target.stack is not None:
            target.stack.check_alive()
        workload = replace(self.workload, pace=spec.pace)
        if spec.start_buffer_ms is not None:  # else the workload's own (capacity sets it there)
            workload = replace(workload, start_buffer_ms=spec.start_buffer_ms)
        cfg = self.cfg
        # Request ids must never repeat: the vocoder keeps finished sessions as tombstones and
        # would answer a reused id's chunks as retries (cached audio, or ABORTED).
        self.num_started += 1
        run_id = f"{self.nonce}-r{self.num_started}-{spec.label}"
        started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        if spec.kind == "closed":
            c = int(spec.level)
            total = c * spec.utterances_per_stream
            progress = Progress(f"    {c:>4} x{spec.utterances_per_stream}", total, not self.quiet)
            warmup = min(cfg.warmup_streams, c)
            timeout = run_timeout_s
        else:
            expected = max(1, math.ceil(spec.level * spec.duration_s))
            progress = Progress(f"    {spec.level:g}/s", expected, not self.quiet)
            warmup = cfg.warmup_streams
            timeout = min(cfg.drain_timeout_s, run_timeout_s)
        plan = LoadPlan(
            spec.kind,
            tuple(target.addresses),
            workload,
            spec.level,
            run_id,
            warmup_streams=warmup,
            stream_timeout_s=cfg.stream_timeout_s,
            timeout_s=timeout,
            utterances_per_stream=spec.utterances_per_stream,
            duration_s=spec.duration_s,
            procs=cfg.client_procs,
        )
        result = run_load(plan, progress)
        pids = target.stack.gpu_pids if target.stack is not None else []
        memory = self.sampler.peak(result.t0, result.t0 + result.window_s, pids)
        return {
            "schema": SCHEMA,
            "kind": spec.kind,
            "label": spec.label,
            "batching": {"on": True, "off": False}.get(spec.label),
            "concurrency": int(spec.level) if spec.kind == "closed" else None,
            "utterances_per_stream": spec.utterances_per_stream if spec.kind == "closed" else None,
            "rate": spec.level if spec.kind == "open" else None,
            "duration_s": spec.duration_s if spec.kind == "open" else None,
            # open loop: the audio s/s asked for; the achieved xRT falls short when overloaded
            "offered_xrt": spec.level * workload.utterance_seconds if spec.kind == "open" else None,
            **self.meta,
            "target": target.address,
            "gateways": len(target.addresses),
            "client_procs": result.procs,  # at most one per closed-loop worker
            "started_at": started_at,
            "workload": asdict(workload),
            "warmup": {"streams": warmup, "errors": result.warmup_errors},
            "max_in_flight": result.max_in_flight,
            "timed_out": result.timed_out,
            "metrics": summarize(result.records, result.window_s),
            "gpu_memory": memory,
            "streams": [stream_summary(r, result.t0) for r in result.records],
        }


def one_line(run: dict) -> str:
    m = run["metrics"]
    fc = m["first_chunk_ms"] or {}
    errs = sum(m["errors"].values())
    xrt = m["xrt"] or 0.0
    return (
        f"xRT {xrt:.1f}, first chunk p50 {fc.get('p50', float('nan')):.0f} ms "
        f"p95 {fc.get('p95', float('nan')):.0f} ms, {m['num_ok']}/{m['num_streams']} ok"
        + (f", {errs} failed {m['errors']}" if errs else "")
        + (f", underrun streams {m['underruns']['streams']}" if m["underruns"]["streams"] else "")
    )


def consistency_problems(run: dict) -> list[str]:
    """What the smoke mode checks: the harness and its arithmetic, never a timing."""
    out = []
    m = run["metrics"]
    name = f"{run['kind']} {run.get('concurrency') or run.get('rate')} {run['label']}"
    if m["errors"] or run["warmup"]["errors"]:
        out.append(f"{name}: errors {m['errors']} (warm-up {run['warmup']['errors']})")
    tokens = run["workload"]["utterance_tokens"]
    for s in run["streams"]:
        if abs(s["audio_s"] - s["tokens"] / TOKEN_RATE) > 1e-9 or s["tokens"] != tokens:
            out.append(f"{name}: stream {s['id']} {s['audio_s']} s for {s['tokens']} tokens")
    if abs(m["audio_s"] - m["tokens"] / TOKEN_RATE) > 1e-6:
        out.append(f"{name}: {m['audio_s']} audio s for {m['tokens']} tokens")
    if m["xrt"] is None or abs(m["xrt"] * m["window_s"] - m["audio_s"]) > 1e-6:
        out.append(f"{name}: xRT {m['xrt']} x window {m['window_s']} != audio {m['audio_s']}")
    for key in ("first_chunk_ms", "chunk_latency_ms", "inter_chunk_gap_ms", "e2e_ms"):
        p = m[key]
        if p is None or not p["p50"] <= p["p95"] <= p["p99"] <= p["max"]:
            out.append(f"{name}: {key} percentiles not ordered: {p}")
    if m["chunks"] != sum(s["chunks"] for s in run["streams"]):
        out.append(f"{name}: chunk total {m['chunks']} != sum over streams")
    return out
