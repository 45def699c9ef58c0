"""A bounded fault-injecting soak of the whole stack on loopback.

    python -m bench soak --duration 180                        # CPU, small preset, 3 minutes
    python -m bench soak --duration 1800 --out-dir docs/bench/soak-DATE   # + JSON and a plot

Starts gateway x2, flow x2 and vocoder x2 as subprocesses (bench/stack.py). Client workers, each
an AsyncClient given both gateway addresses (so a stream whose gateway dies resumes on the other
with StreamConfig.resume_from_sample), run streams while faults come one at a time, every kind
once per round in a random order: SIGKILL and SIGTERM of a flow replica, a vocoder replica and a
gateway (restarted on the same port), and bursts of undecodable bytes at every service. Some
clients cancel mid-stream; some stop reading for --slow-pause seconds (the gateway's bounded
queue holds their audio; the stream must still complete, or fail with a clean status).

First every input runs once through the stack undisturbed: the reference audio. After each fault
a probe stream (a fresh client, both gateways) runs until one succeeds: the time to recover a
client sees; the time until the faulted process is SERVING again is recorded too. Every
--sample-interval seconds: RSS of each process and the open streams and sessions from the
services' /metrics.

It stops by itself after --duration (or --max-streams-total streams) and prints a table:
streams by outcome, faults by kind, resumes, samples lost and duplicated, streams whose audio
differs from the reference by more than --atol, streams in flight at a process fault that then
failed, recovery times, RSS and open sessions over time. --out-dir also writes soak.json (all
of it, the time series included) and soak.png (matplotlib, when installed).

Exit status 1 when a sample was lost or duplicated, audio differed, a stream in flight at a
fault failed, a slow client's stream did not end cleanly, a client never recovered, or any call
ended INTERNAL/UNKNOWN. Loopback only; nothing leaves the host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from bench.stack import Stack, StackConfig, free_port
from gateway.client import AsyncClient
from token2wav import SAMPLES_PER_TOKEN
from token2wav.healthcheck import check
from token2wav.tensors import make_voice

FUZZ_METHODS = [
    ("flow_service", "/token2wav.v1.Flow/Generate"),
    ("vocoder_service", "/token2wav.v1.Vocoder/CancelSession"),
    ("gateway", "/token2wav.v1.Gateway/RegisterVoice"),
]
BAD_CODES = {"INTERNAL", "UNKNOWN"}
FAULT_KINDS = [
    f"{how}_{what}" for what in ("flow", "vocoder", "gateway") for how in ("kill", "term")
] + ["fuzz"]
# What each service's /metrics says is open now (a gauge per process; summed per kind).
GAUGES = {
    "gateway": ["t2w_gateway_active_streams"],
    "vocoder_service": ["t2w_vocoder_active_sessions", "t2w_vocoder_closed_sessions"],
    "flow_service": ["t2w_flow_prefix_cache_entries", "t2w_flow_prefix_cache_bytes"],
}
RECOVERY_BOUND_S = 120.0  # a probe that has not succeeded by then counts as never recovered
PROBE_TOKENS = 25  # a 1 s probe stream: its time to finish is mostly the time to recover
PROBE_KEYS = ("new_stream_audio_after_s", "new_stream_ok_after_s")


@dataclass
class Tally:
    outcomes: Counter = field(
        default_factory=Counter
    )  # "OK" / status code name / "CANCELLED_BY_CLIENT"
    faults: Counter = field(default_factory=Counter)  # kind -> count
    samples_lost: int = 0
    samples_duplicated: int = 0
    audio_mismatch: int = 0
    max_abs_diff: float = 0.0  # largest |audio - reference| over the OK streams
    resumes: int = 0  # resumes over all streams
    resumed_streams: int = 0  # streams that resumed at least once and ended OK
    admitted_failed: Counter = field(default_factory=Counter)  # "fault kind: code" -> streams
    slow: Counter = field(default_factory=Counter)  # slow clients' streams by outcome
    probe_errors: Counter = field(default_factory=Counter)  # probe attempts that failed, by code
    references: dict[int, np.ndarray] = field(default_factory=dict)  # input -> undisturbed audio
    active: dict[int, bool] = field(default_factory=dict)  # stream -> got its first chunk
    watched: dict[int, str] = field(default_factory=dict)  # in flight at a fault -> its kind
    series: list[dict] = field(default_factory=list)  # one per sample: t, RSS, open sessions
    events: list[dict] = field(default_factory=list)  # one per fault: when, what, recovery


def make_inputs(n: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        n_p = int(rng.integers(8, 30))
        voice = make_voice(
            rng.integers(0, 6561, n_p),
            (rng.standard_normal((2 * n_p, 80)) - 4).astype(np.float32),
            rng.standard_normal(192).astype(np.float32),
        )
        out.append((voice, rng.integers(0, 6561, int(rng.integers(60, 400)))))
    return out


def account(chunks, n_tokens: int, tally: Tally) -> np.ndarray:
    """Samples lost and duplicated from seq/sample_offset bookkeeping; the audio."""
    total = 0
    for c in chunks:
        if c.sample_offset < total:
            tally.samples_duplicated += total - c.sample_offset
        elif c.sample_offset > total:
            tally.samples_lost += c.sample_offset - total
        total = max(total, c.sample_offset + c.samples.size)
    tally.samples_lost += max(0, SAMPLES_PER_TOKEN * n_tokens - total)
    return np.concatenate([c.samples for c in chunks]) if chunks else np.zeros(0, np.float32)


def settle(tally: Tally, k: int, chunks, n_tokens: int, num_resumes: int, atol: float) -> bool:
    """Book a stream that ended OK: its samples (lost, duplicated), its resumes and its audio
    against input k's reference; True when the audio matches (no reference yet: it becomes
    one)."""
    tally.outcomes["OK"] += 1
    tally.resumes += num_resumes
    tally.resumed_streams += num_resumes > 0
    audio = account(chunks, n_tokens, tally)
    ref = tally.references.setdefault(k, audio)
    if ref is audio:
        return True
    if ref.size != audio.size:
        tally.audio_mismatch += 1
        return False
    diff = float(np.max(np.abs(audio - ref))) if ref.size else 0.0
    tally.max_abs_diff = max(tally.max_abs_diff, diff)
    if diff > atol:
        tally.audio_mismatch += 1
        return False
    return True


def book_failure(tally: Tally, sid: int, code: str, details: str) -> None:
    """A stream that ended with a status: by code, and against the fault it was in flight at."""
    tally.outcomes[code] += 1
    kind = tally.watched.get(sid)
    if kind is not None:
        tally.admitted_failed[f"{kind}: {code}"] += 1
        print(f"stream {sid} in flight at {kind} failed: {code} {details}", flush=True)
    elif code != "RESOURCE_EXHAUSTED":
        print(f"stream {sid}: {code}: {details}", flush=True)


async def one_stream(client, sid: int, inputs, k: int, rng: random.Random, tally: Tally, args):
    voice, tokens = inputs[k]
    stream = client.stream(voice, audio_format="float32", request_id=f"soak-{sid}")
    cancel_at = rng.randrange(1, 4) if rng.random() < args.cancel_p else None
    slow = rng.random() < args.slow_p
    chunks = []
    outcome = "OK"
    tally.active[sid] = False

    async def feed():
        i = 0
        while i < len(tokens):
            n = rng.randint(5, 40)
            await stream.send(tokens[i : i + n])
            i += n
            await asyncio.sleep(rng.uniform(0, 0.1))  # an LLM's pace, roughly
        await stream.end()

    feeder = asyncio.ensure_future(feed())
    try:
        async for c in stream:
            tally.active[sid] = True
            chunks.append(c)
            if slow and len(chunks) == 1:
                tally.faults["slow_client"] += 1
                await asyncio.sleep(args.slow_pause)  # stops reading; the gateway must hold on
            if cancel_at is not None and len(chunks) >= cancel_at:
                stream.cancel()
                tally.faults["client_cancel"] += 1
                outcome = "CANCELLED_BY_CLIENT"
                tally.outcomes[outcome] += 1
                return
    except grpc.aio.AioRpcError as exc:
        outcome = exc.code().name
        book_failure(tally, sid, outcome, exc.details())
        if outcome == "RESOURCE_EXHAUSTED":
            await asyncio.sleep(rng.uniform(0.1, 0.5))  # a client backs off when refused
        return
    except asyncio.CancelledError:
        outcome = "CANCELLED_BY_CLIENT"
        tally.outcomes[outcome] += 1
        return
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        tally.active.pop(sid, None)
        tally.watched.pop(sid, None)
        if slow:
            tally.slow[outcome] += 1
    if not settle(tally, k, chunks, len(tokens), stream.num_resumes, args.atol):
        print(f"stream {sid}: audio differs from input {k}'s reference", flush=True)


def worker_targets(targets: list[str], w: int) -> list[str]:
    """Worker w's gateway list, rotated so that the workers' first choices spread evenly."""
    i = w % len(targets)
    return targets[i:] + targets[:i]


async def references(targets, inputs, tally: Tally) -> None:
    """Every input once, all at once, before any fault: the undisturbed audio."""

    async def one(k):
        voice, tokens = inputs[k]
        async with AsyncClient(worker_targets(targets, k), resume_attempts=0) as client:
            stream = client.stream(voice, audio_format="float32", request_id=f"reference-{k}")
            await stream.send(tokens)
            await stream.end()
            chunks = [c async for c in stream]
        ref = Tally()
        tally.references[k] = account(chunks, len(tokens), ref)
        if ref.samples_lost or ref.samples_duplicated:
            raise RuntimeError(f"reference run of input {k}: samples lost or duplicated")

    await asyncio.gather(*[one(k) for k in range(len(inputs))])


async def clients(targets, inputs, args, tally: Tally, stop_at: float, rng: random.Random):
    sid = 0
    budget = args.max_streams_total

    async def worker(w: int):
        nonlocal sid, budget
        async with AsyncClient(
            worker_targets(targets, w),
            resume_attempts=args.resume_attempts,
            resume_within_s=args.resume_within_s,
        ) as client:
            while time.monotonic() < stop_at and budget > 0:
                budget -= 1
                sid += 1
                await one_stream(client, sid, inputs, rng.randrange(len(inputs)), rng, tally, args)

    await asyncio.gather(*[worker(w) for w in range(args.clients)])


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def scrape(port: int | str, names: list[str]) -> dict[str, float]:
    """The named gauges from a service's /metrics (a loopback port, or "HOST:PORT"); {} when it
    is down."""
    addr = port if isinstance(port, str) else f"127.0.0.1:{port}"
    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value)
    return out


class SoakStack(Stack):
    """The bench stack with a metrics port per process (kept across restarts), for the gauges."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.metrics_ports = {name: free_port() for name in self.ports}

    def commands(self) -> dict[str, list[str]]:
        # after the stack's own "--metrics-port 0": argparse keeps the last value
        return {
            name: [*cmd, "--metrics-port", str(self.metrics_ports[name])]
            for name, cmd in super().commands().items()
        }


def module_of(name: str) -> str:
    return name.split(".", 1)[0]


async def wait_serving(stack: Stack, name: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    addr = f"127.0.0.1:{stack.ports[name]}"
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check, addr, "", 1.0):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{name} did not come back within {timeout:.0f} s")


async def probe(
    targets, inputs, tally: Tally, since: float, label: str
) -> tuple[float | None, float | None]:
    """Seconds from `since` until a fresh client (both gateways, the default resume bounds)
    gets a short stream's first audio, and until the stream has all of it; None past the
    bound."""
    voice, tokens = inputs[0][0], inputs[0][1][:PROBE_TOKENS]
    n = 0
    while time.monotonic() - since < RECOVERY_BOUND_S:
        n += 1
        first = None
        try:
            async with AsyncClient(targets) as client:
                stream = client.stream(
                    voice, audio_format="float32", request_id=f"probe-{label}-{n}"
                )
                await stream.send(tokens)
                await stream.end()
                got = 0
                async for c in stream:
                    first = first or time.monotonic() - since
                    got += c.samples.size
            if got == SAMPLES_PER_TOKEN * len(tokens):
                return first, time.monotonic() - since
            tally.probe_errors["SHORT"] += 1
        except grpc.aio.AioRpcError as exc:
            tally.probe_errors[exc.code().name] += 1
            print(
                f"probe {n} at +{time.monotonic() - since:.1f} s: {exc.code().name}: "
                f"{exc.details()}",
                flush=True,
            )
        await asyncio.sleep(0.1)
    return None, None


async def fault(
    stack: Stack, kind: str, tally: Tally, rng: random.Random, t0, inputs, spare: bool = False
) -> None:
    if kind == "fuzz":
        for _ in range(20):
            module, method = rng.choice(FUZZ_METHODS)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports[module]}") as ch:
                try:
                    await ch.unary_unary(method)(rng.randbytes(rng.randint(1, 200)), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    if exc.code().name in BAD_CODES:
                        tally.outcomes[f"fuzz_{exc.code().name}"] += 1
        tally.faults["fuzz_burst"] += 1
        tally.events.append({"t": round(time.monotonic() - t0, 2), "kind": kind})
        return
    how, what = kind.split("_", 1)  # kill_vocoder, term_gateway, ...
    module = "gateway" if what == "gateway" else f"{what}_service"
    names = [n for n in stack.procs if module_of(n) == module]
    if spare:  # the first process of each kind takes every fault; the others live throughout
        names = names[:1]
    name = rng.choice(names)
    proc = stack.procs[name]
    in_flight = [s for s, admitted in tally.active.items() if admitted]
    tally.watched.update((s, kind) for s in in_flight if s not in tally.watched)
    at = time.monotonic()
    proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGTERM)
    label = str(len(tally.events))
    probing = asyncio.ensure_future(probe(stack.targets(), inputs, tally, at, label))
    await asyncio.to_thread(proc.wait, 60)
    exited = time.monotonic() - at
    tally.faults[kind] += 1
    await asyncio.sleep(rng.uniform(0.5, 2.0))  # down for a moment
    stack.spawn(name, restart=True)
    await wait_serving(stack, name)
    serving = time.monotonic() - at
    first_audio, stream_ok = await probing
    tally.events.append(
        {
            "t": round(at - t0, 2),
            "kind": kind,
            "process": name,
            "exit_status": proc.returncode,
            "in_flight": len(in_flight),
            "exited_after_s": round(exited, 2),
            "serving_again_after_s": round(serving, 2),
            "new_stream_audio_after_s": None if first_audio is None else round(first_audio, 2),
            "new_stream_ok_after_s": None if stream_ok is None else round(stream_ok, 2),
        }
    )


async def faults(stack, args, tally: Tally, stop_at: float, rng: random.Random, t0, inputs):
    kinds = [k for k in FAULT_KINDS if k in args.faults]
    n = 0
    while time.monotonic() + args.fault_interval < stop_at:
        await asyncio.sleep(args.fault_interval)
        if n % len(kinds) == 0:
            rng.shuffle(kinds)  # every kind once per round, in a random order
        await fault(stack, kinds[n % len(kinds)], tally, rng, t0, inputs, args.spare_replicas)
        n += 1


def sample(stack: SoakStack, tally: Tally, t0: float) -> dict:
    row: dict = {"t": round(time.monotonic() - t0, 1), "client_streams": len(tally.active)}
    row["rss_mib"] = {name: rss_mib(p.pid) for name, p in stack.procs.items()}
    gauges: dict[str, float] = {}
    for name, port in stack.metrics_ports.items():
        for g, v in scrape(port, GAUGES[module_of(name)]).items():
            gauges[g] = gauges.get(g, 0.0) + v
    row["open"] = gauges
    row["streams_ok"] = tally.outcomes["OK"]
    return row


async def sampler(stack: SoakStack, tally: Tally, stop_at: float, t0: float, interval: float):
    while True:
        tally.series.append(await asyncio.to_thread(sample, stack, tally, t0))
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(min(interval, max(0.0, stop_at - time.monotonic())))


def recovery(tally: Tally) -> dict[str, dict]:
    """Per fault kind: count, and the worst and median seconds to SERVING / to a new stream."""
    out = {}
    for kind in FAULT_KINDS[:-1]:
        evs = [e for e in tally.events if e["kind"] == kind]
        if not evs:
            continue
        row = {"count": len(evs)}
        for key in ("serving_again_after_s", *PROBE_KEYS):
            vals = [e[key] for e in evs if e[key] is not None]
            row[key] = {
                "median": round(float(np.median(vals)), 2) if vals else None,
                "max": round(max(vals), 2) if vals else None,
                "never": len(evs) - len(vals),
            }
        out[kind] = row
    return out


def flatness(tally: Tally) -> dict[str, dict]:
    """Per process: RSS at the first sample after warm-up (a quarter in), at the end, and the
    largest seen; a restarted process starts small again, so the end is what shows a leak."""
    if not tally.series:
        return {}
    start = tally.series[len(tally.series) // 4]["rss_mib"]
    end = tally.series[-1]["rss_mib"]
    out = {}
    for name in end:
        seen = [r["rss_mib"].get(name) for r in tally.series]
        seen = [v for v in seen if v is not None]
        out[name] = {"quarter": start.get(name), "end": end.get(name), "max": max(seen)}
    return out


def table(tally: Tally, elapsed: float) -> str:
    streams = sum(tally.outcomes[k] for k in tally.outcomes if not k.startswith("fuzz_"))
    lines = [f"soak: {elapsed:.0f} s, {streams} streams", "", "| what | count |", "|---|---|"]
    lines += [f"| streams ended {k} | {v} |" for k, v in sorted(tally.outcomes.items())]
    lines += [f"| fault {k} | {v} |" for k, v in sorted(tally.faults.items())]
    lines += [f"| slow client's stream ended {k} | {v} |" for k, v in sorted(tally.slow.items())]
    lines += [
        f"| resumes (streams resumed, ended OK) | {tally.resumes} ({tally.resumed_streams}) |",
        f"| samples lost | {tally.samples_lost} |",
        f"| samples duplicated | {tally.samples_duplicated} |",
        f"| audio differs from the undisturbed run (> atol) | {tally.audio_mismatch} |",
        f"| largest abs difference from it | {tally.max_abs_diff:.2e} |",
        f"| in flight at a process fault, then failed | {sum(tally.admitted_failed.values())} |",
    ]
    lines += [f"| ... at {k} | {v} |" for k, v in sorted(tally.admitted_failed.items())]
    lines += [f"| probe attempt failed {k} | {v} |" for k, v in sorted(tally.probe_errors.items())]
    lines += [
        "",
        "| fault | n | process SERVING again, median / max s | a new stream's first audio "
        f"| the new {PROBE_TOKENS}-token stream complete |",
        "|---|---|---|---|---|",
    ]
    for kind, r in recovery(tally).items():
        s, a, n = (r[k] for k in ("serving_again_after_s", *PROBE_KEYS))
        never = f" ({n['never']} never)" if n["never"] else ""
        lines.append(
            f"| {kind} | {r['count']} | {s['median']} / {s['max']} | "
            f"{a['median']} / {a['max']} | {n['median']} / {n['max']}{never} |"
        )
    lines += ["", "| process | RSS MiB a quarter in | at the end | max |", "|---|---|---|---|"]
    lines += [
        f"| {name} | {r['quarter']} | {r['end']} | {r['max']} |"
        for name, r in flatness(tally).items()
    ]
    if tally.series:
        keys = sorted({g for r in tally.series for g in r["open"]})
        lines += ["", "| t s | client streams | " + " | ".join(keys) + " |"]
        lines += ["|---" * (len(keys) + 2) + "|"]
        step = max(1, len(tally.series) // 12)
        for r in tally.series[::step]:
            vals = " | ".join(f"{r['open'].get(k, float('nan')):g}" for k in keys)
            lines.append(f"| {r['t']:.0f} | {r['client_streams']} | {vals} |")
    return "\n".join(lines)


def failed(tally: Tally) -> list[str]:
    """Which bars the run missed (empty: it passed)."""
    bad = sum(v for k, v in tally.outcomes.items() if k.removeprefix("fuzz_") in BAD_CODES)
    bad += sum(v for k, v in tally.probe_errors.items() if k in BAD_CODES)
    unclean = sum(v for k, v in tally.slow.items() if k in BAD_CODES)
    never = sum(r["new_stream_ok_after_s"]["never"] for r in recovery(tally).values())
    bars = {
        "samples lost": tally.samples_lost,
        "samples duplicated": tally.samples_duplicated,
        "audio mismatches": tally.audio_mismatch,
        "streams in flight at a fault that failed": sum(tally.admitted_failed.values()),
        "INTERNAL/UNKNOWN": bad,
        "slow clients ending INTERNAL/UNKNOWN": unclean,
        "faults a client never recovered from": never,
    }
    return [f"{k}: {v}" for k, v in bars.items() if v]


def report(tally: Tally, elapsed: float, args, argv: list[str]) -> dict:
    return {
        "command": "python -m bench soak " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "seconds": round(elapsed, 1),
        "streams": sum(v for k, v in tally.outcomes.items() if not k.startswith("fuzz_")),
        "outcomes": dict(tally.outcomes),
        "faults": dict(tally.faults),
        "slow_client_outcomes": dict(tally.slow),
        "resumes": tally.resumes,
        "resumed_streams_ok": tally.resumed_streams,
        "samples_lost": tally.samples_lost,
        "samples_duplicated": tally.samples_duplicated,
        "audio_mismatch": tally.audio_mismatch,
        "atol": args.atol,
        "max_abs_diff": tally.max_abs_diff,
        "in_flight_at_fault_failed": dict(tally.admitted_failed),
        "probe_errors": dict(tally.probe_errors),
        "recovery": recovery(tally),
        "rss_flatness_mib": flatness(tally),
        "missed_bars": failed(tally),
        "events": tally.events,
        "series": tally.series,
    }


def plot(data: dict, path: Path) -> bool:
    from bench.plots import _pyplot

    plt = _pyplot()
    if plt is None:
        return False
    series = data["series"]
    t = [r["t"] / 60 for r in series]
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for name in sorted({n for r in series for n in r["rss_mib"]}):
        a.plot(t, [r["rss_mib"].get(name) or np.nan for r in series], label=name)
    a.set_ylabel("RSS MiB")
    a.legend(fontsize=7, ncol=3)
    b.plot(t, [r["client_streams"] for r in series], label="client streams open", color="k")
    for g in sorted({g for r in series for g in r["open"] if not g.endswith("_bytes")}):
        b.plot(t, [r["open"].get(g, np.nan) for r in series], label=g.removeprefix("t2w_"))
    b.set_ylabel("open now")
    b.legend(fontsize=7)
    colors = {"flow": "tab:blue", "vocoder": "tab:orange", "gateway": "tab:red"}
    for e in data["events"]:
        what = e["kind"].split("_", 1)[-1]
        if what in colors:
            for ax in (a, b):
                ax.axvline(e["t"] / 60, color=colors[what], alpha=0.25, lw=0.8)
            mark = "x" if e["kind"].startswith("kill") else "o"
            for key, y in (("serving_again_after_s", 0), ("new_stream_audio_after_s", 1)):
                if e[key] is not None:
                    c.scatter(
                        e["t"] / 60,
                        e[key],
                        color=colors[what],
                        marker=mark,
                        alpha=1.0 if y else 0.4,
                        s=18,
                    )
    c.set_ylabel("s to recover")
    c.set_yscale("log")
    c.set_xlabel("minutes")
    c.set_title(
        "after each fault: solid = a new client's first audio, faint = process SERVING again; "
        "x SIGKILL, o SIGTERM; blue flow, orange vocoder, red gateway",
        fontsize=8,
    )
    fig.suptitle(f"soak: {data['streams']} streams, {data['seconds'] / 60:.0f} min", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


async def soak(args, argv: list[str]) -> int:
    rng = random.Random(args.seed)
    inputs = make_inputs(args.num_inputs, args.seed)
    config = StackConfig(
        flow_replicas=2,
        vocoder_replicas=2,
        gateways=2,
        threads=1,
        flow_args=("--max-wait-ms", "2", "--grace-period", "3", *args.flow_arg),
        vocoder_args=("--grace-period", "3"),
        gateway_args=(
            "--max-streams",
            str(args.max_streams),
            "--health-check-interval",
            "0.5",
            "--vocoder-failovers",
            "5",
            "--grace-period",
            str(args.gateway_grace),
        ),
    )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="t2w-soak-"))
    stack = SoakStack(config, log_dir, name="soak")
    tally = Tally()
    with stack:
        stack.start()
        await asyncio.to_thread(stack.wait_ready)
        await references(stack.targets(), inputs, tally)
        t0 = time.monotonic()
        stop_at = t0 + args.duration
        await asyncio.gather(
            clients(stack.targets(), inputs, args, tally, stop_at, rng),
            faults(stack, args, tally, stop_at, rng, t0, inputs),
            sampler(stack, tally, stop_at, t0, args.sample_interval),
        )
        elapsed = time.monotonic() - t0
        tally.series.append(await asyncio.to_thread(sample, stack, tally, t0))
    print(table(tally, elapsed))
    print(f"\nservice logs: {log_dir}")
    data = report(tally, elapsed, args, argv)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(data, indent=1) + "\n")
        drawn = plot(data, out / "soak.png")
        print(f"wrote {out / 'soak.json'}" + (f" and {out / 'soak.png'}" if drawn else ""))
    missed = failed(tally)
    for m in missed:
        print(f"missed bar: {m}", file=sys.stderr)
    return 1 if missed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load (it stops)")
    p.add_argument(
        "--max-streams",
        type=int,
        default=8,
        help="each gateway's --max-streams; the default lets one gateway carry every client "
        "while the other is down",
    )
    p.add_argument("--clients", type=int, default=6, help="client workers, one stream at a time")
    p.add_argument("--max-streams-total", type=int, default=100_000, help="stop after this many")
    p.add_argument("--fault-interval", type=float, default=8.0, help="seconds between faults")
    p.add_argument(
        "--faults",
        type=lambda s: [k.strip() for k in s.split(",") if k.strip()],
        default=FAULT_KINDS,
        help=f"comma-separated fault kinds, from {','.join(FAULT_KINDS)} (default: all)",
    )
    p.add_argument(
        "--spare-replicas",
        action="store_true",
        help="fault only the first gateway, flow and vocoder process; the second of each lives "
        "the whole run, so its RSS over time shows a leak (it still carries the load)",
    )
    p.add_argument(
        "--flow-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for the flow replicas, repeatable (--flow-arg=--prefix-cache-mb=64: "
        "a cache that fills within the run, so the flow's RSS must level off)",
    )
    p.add_argument("--cancel-p", type=float, default=0.1, help="share of streams that cancel")
    p.add_argument(
        "--slow-p", type=float, default=0.1, help="share of streams whose client stops reading"
    )
    p.add_argument("--slow-pause", type=float, default=10.0, help="seconds a slow client pauses")
    p.add_argument(
        "--gateway-grace",
        type=float,
        default=5.0,
        help="gateways' --grace-period: a SIGTERMed gateway's streams get this long, then resume",
    )
    p.add_argument("--resume-attempts", type=int, default=3, help="the clients' resume_attempts")
    p.add_argument(
        "--resume-within-s", type=float, default=30.0, help="the clients' resume_within_s"
    )
    p.add_argument(
        "--atol", type=float, default=1e-4, help="largest abs difference from the reference"
    )
    p.add_argument("--num-inputs", type=int, default=6, help="distinct voice+token inputs")
    p.add_argument("--sample-interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--log-dir", default="", help="service logs (default: a temp dir)")
    p.add_argument("--out-dir", default="", help="also write soak.json and soak.png here")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    unknown = sorted(set(args.faults) - set(FAULT_KINDS))
    if unknown:
        build_parser().error(f"--faults: unknown kinds {unknown}; from {FAULT_KINDS}")
    return asyncio.run(soak(args, argv))
