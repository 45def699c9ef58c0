"""Real-time capacity: how many streams one stack keeps talking without a gap.

Definitions (docs/BENCHMARKS.md, "Real-time capacity"):
  on time             a stream that completed and whose playback, started when its first chunk
                      arrived, needed at most STACK_TOLERANCE_S (20 ms) of buffer beyond what its
                      token input forces (bench.metrics: excess buffer, the "added by stack"
                      figure). A refused or failed stream is not on time. With tokens at a pace
                      the input-forced schedule includes each chunk's compute floor (its
                      latency through the idle stack, measured first by --floor-streams
                      streams alone, median per chunk): chunk k cannot come out sooner than
                      that after its tokens on any stack (bench.metrics.excess_buffer_ms).
  real-time capacity  the highest Poisson arrival rate (streams/s; x utterance seconds = audio
                      s/s) at which >= 99 % of the streams are on time and the first-chunk p95
                      is <= 250 ms. Found by stepping the rate up geometrically from
                      --start-rate until a probe fails, then bisecting (geometric mean) between
                      the last pass and the first fail --refine times. Concurrent streams at
                      capacity by Little's law: rate x mean stream duration.
  overload            Poisson arrivals at --overload-factor x capacity for --overload-duration s
                      through a second gateway with admission control on (same flow and vocoder
                      services): the share of admitted streams on time, refusals' latency, and
                      the services' gauges (flow queue depth, vocoder sessions, gateway streams,
                      GPU memory) before the load and after it drained.

`search()` and `on_time_figures()` are pure (the tests drive them with fake probes).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from bench.metrics import STACK_TOLERANCE_S, excess_buffer_ms, percentiles, stall_post_mortem
from bench.report import STALLED_LEGEND, environment, run_name, stall_line
from bench.stack import Stack, StackConfig, free_port
from bench.sweep import RunSpec, Sweep, SweepConfig, Target, one_line
from bench.workload import InvalidConfig, WorkloadConfig

REFUSED = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class Criteria:
    on_time_share: float = 0.99
    first_chunk_p95_ms: float = 250.0


def _excess_ms(stream: dict, floors_ms: list[float] | None) -> float:
    if floors_ms is None or "chunk_latency_ms" not in stream:
        return stream.get("excess_buffer_ms", math.inf)
    return excess_buffer_ms(
        stream["chunk_arrivals_ms"], stream["chunk_latency_ms"], stream["chunk_samples"], floors_ms
    )


def compute_floors(run: dict) -> list[float] | None:
    """Per chunk seq, the median tokens-in -> audio-out latency (ms) of a run's completed
    streams: with streams run one at a time, what the idle stack needs for each chunk."""
    lines = [s["chunk_latency_ms"] for s in run["streams"] if s.get("chunk_latency_ms")]
    if not lines:
        return None
    n = max(map(len, lines))
    return [float(percentiles([x[k] for x in lines if len(x) > k])["p50"]) for k in range(n)]


def on_time_figures(run: dict, utterance_s: float, floors_ms: list[float] | None = None) -> dict:
    """The capacity figures of one run (its per-stream lines and metrics); `floors_ms`: the
    per-chunk compute floors of the input-forced schedule (None: zero compute)."""
    streams = run["streams"]
    refused = [s for s in streams if s["status"] == REFUSED]
    admitted = [s for s in streams if s["status"] != REFUSED]
    tol_ms = STACK_TOLERANCE_S * 1e3
    excess = {id(s): _excess_ms(s, floors_ms) for s in admitted if s["status"] == "OK"}
    on_time = [s for s in admitted if s["status"] == "OK" and excess[id(s)] <= tol_ms]
    n = len(streams)
    m = run["metrics"]
    e2e = m.get("e2e_ms") or {}
    rate = run.get("rate")
    fc = m.get("first_chunk_ms") or {}
    return {
        "rate": rate,
        "pace": run["workload"]["pace"],
        "offered_audio_s_per_s": rate * utterance_s if rate else None,
        "streams": n,
        "admitted": len(admitted),
        "refused": len(refused),
        "on_time": len(on_time),
        "on_time_share": len(on_time) / n if n else None,
        "admitted_on_time_share": len(on_time) / len(admitted) if admitted else None,
        "first_chunk_p95_ms": fc.get("p95"),
        "first_chunk_p50_ms": fc.get("p50"),
        "excess_buffer_p99_ms": (
            (m["underruns"].get("excess_buffer_ms") or {}).get("p99")
            if floors_ms is None
            else (percentiles(list(excess.values())) or {}).get("p99")
        ),
        "excess_buffer_p99_ms_no_floors": (m["underruns"].get("excess_buffer_ms") or {}).get("p99"),
        "on_time_no_floors": sum(
            s["status"] == "OK" and s.get("excess_buffer_ms", math.inf) <= tol_ms for s in admitted
        ),
        "refusal_ms": percentiles([s["closed_ms"] for s in refused if "closed_ms" in s]),
        "concurrent_streams": rate * e2e["mean"] / 1e3 if rate and e2e.get("mean") else None,
        "xrt": m.get("xrt"),
        "errors": m.get("errors", {}),
        "stalled": stall_post_mortem(
            [s for s in admitted if s["status"] == "OK" and excess[id(s)] > tol_ms]
        ),
    }


def passes(fig: dict, criteria: Criteria) -> bool:
    share, p95 = fig["on_time_share"], fig["first_chunk_p95_ms"]
    return (
        share is not None
        and p95 is not None
        and share >= criteria.on_time_share
        and p95 <= criteria.first_chunk_p95_ms
    )


def highest_passing_without_floors(probes: list[dict], criteria: Criteria) -> float | None:
    """The highest probed rate that passes when "on time" is the zero-compute test (playback
    pauses at most 20 ms beyond what the token input alone forces; issue 16's wording), where
    the search itself used compute floors. A probed rate, not a bisected capacity: the search
    chose its rates by the other test."""
    good = [
        f["rate"]
        for f in probes
        if f["streams"]
        and f.get("on_time_no_floors") is not None
        and passes(dict(f, on_time_share=f["on_time_no_floors"] / f["streams"]), criteria)
    ]
    return max(good, default=None)


def search(
    probe: Callable[[float], dict],
    criteria: Criteria,
    start_rate: float,
    max_rate: float,
    growth: float = 1.5,
    refine: int = 2,
    can_probe: Callable[[], bool] = lambda: True,
) -> tuple[float | None, list[dict]]:
    """(capacity rate or None, the probes' figures in the order made). `probe(rate)` runs one
    Poisson run and returns its figures; `can_probe()` says whether time is left for one."""
    probes: list[dict] = []
    good: float | None = None
    bad: float | None = None

    def run(rate: float) -> bool:
        fig = probe(rate)
        fig["passed"] = passes(fig, criteria)
        probes.append(fig)
        return fig["passed"]

    rate = start_rate
    while can_probe():  # up until a failure (or the cap)
        if run(rate):
            good = rate
            if rate >= max_rate:
                break
            rate = min(max_rate, rate * growth)
        else:
            bad = rate
            break
    while good is None and bad is not None and can_probe() and bad / growth >= start_rate / 8:
        rate = bad / growth  # the start already failed: step down
        if run(rate):
            good = rate
        else:
            bad = rate
    for _ in range(refine):
        if good is None or bad is None or not can_probe():
            break
        mid = math.sqrt(good * bad)
        if run(mid):
            good = mid
        else:
            bad = mid
    return good, probes


# -- the services' gauges ---------------------------------------------------------------------

IDLE_GAUGES = {
    "gateway": ("t2w_gateway_active_streams",),
    "flow_service": ("t2w_flow_queue_depth",),
    "vocoder_service": ("t2w_vocoder_active_sessions",),
}


def scrape(port: int, names: tuple[str, ...]) -> dict[str, float | None]:
    """Current values of unlabelled gauges from a Prometheus endpoint (None if unreachable)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {n: None for n in names}
    out: dict[str, float | None] = {}
    for n in names:
        m = re.search(rf"^{re.escape(n)} (\S+)$", text, re.MULTILINE)
        out[n] = float(m.group(1)) if m else None
    return out


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(int(x) for x in out.split() if x.strip().isdigit())


def idle_snapshot(metrics_ports: dict[str, int]) -> dict:
    snap: dict = {"gpu_used_mib": gpu_used_mib()}
    for module, port in metrics_ports.items():
        snap.update(scrape(port, IDLE_GAUGES[module]))
    return snap


def back_to_idle(before: dict, after: dict) -> bool:
    """Queues empty, no streams or sessions left (GPU memory is reported, not judged: the
    allocator keeps its cache)."""
    keys = [k for names in IDLE_GAUGES.values() for k in names]
    return all(after.get(k) == 0 for k in keys if before.get(k) is not None)


# -- report -----------------------------------------------------------------------------------


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def _stages(st: dict | None) -> str:
    if not st:
        return "-"
    return (
        f"{st['flow_queue_ms']:.0f} + {st['flow_compute_ms']:.0f}, "
        f"{st['vocoder_queue_ms']:.0f} + {st['vocoder_compute_ms']:.0f}, "
        f"{st['gateway_ms']:.0f}, {st['wire_ms']:.0f}"
    )


def _plural(n: int, noun: str, suffix: str = "s") -> str:
    return f"{n} {noun}{'' if n == 1 else suffix}"


def render(result: dict) -> str:
    crit = Criteria(**result.get("criteria", {}))  # results written before it was kept: defaults
    lines = [
        f"# Real-time capacity ({result['dtype']}, {result['preset']}, {result['device']})",
        "",
        f"Command: `{result['command']}`  ",
        f"Started {result['started_at']}, commit {result.get('commit', '?')}; "
        f"{result['workload']}; {_plural(result.get('gateways', 1), 'gateway')} (the overload "
        f"run: one with admission on), load from "
        f"{_plural(result.get('client_procs', 1), 'client process', 'es')}. On time: completed with <= 20 ms of buffer beyond what the "
        "token input forces; capacity: highest Poisson rate with "
        f">= {crit.on_time_share * 100:g} % of streams on time "
        f"and first chunk p95 <= {crit.first_chunk_p95_ms:g} ms.",
        "",
    ]
    if result.get("closed"):
        lines += [
            "## Closed loop (one utterance per stream, all starting together)",
            "",
            "| gateway | streams | xRT | first chunk p50 / p95 ms | stack-stalled streams | "
            "excess buffer p95 ms | errors | first chunk means ms: flow queue + compute, "
            "vocoder queue + compute, gateway, wire |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in result["closed"]:
            lines.append(
                f"| {c['gateway']} | {c['concurrency']} | {_fmt(c['xrt'])} | "
                f"{_fmt(c['first_p50'], '.0f')} / {_fmt(c['first_p95'], '.0f')} | "
                f"{c['stack_streams']} of {c['streams']} | {_fmt(c['excess_p95'], '.0f')} | "
                f"{c['errors'] or '-'} | {_stages(c.get('first_stages'))} |"
            )
        lines.append("")
    for key, search_result in result.get("capacity", {}).items():
        cap = search_result["capacity_rate"]
        lines += [
            f"## Capacity, tokens {key}",
            "",
            "**capacity: "
            + (
                f"{cap:.2f} streams/s = {search_result['capacity_audio_s_per_s']:.0f} audio s/s, "
                f"~{_fmt(search_result['capacity_concurrent'], '.0f')} concurrent streams**"
                if cap
                else "not found (no probed rate passed)**"
            ),
            "",
        ]
        floors = search_result.get("compute_floors_ms")
        if floors:
            lines += [
                "Compute floors (each chunk's latency through the idle stack, median of streams "
                "run alone; part of the input-forced schedule): "
                + ", ".join(f"{v:.0f}" for v in floors)
                + " ms. On time without them (zero compute, the first pass's definition): "
                + ", ".join(
                    f"{f['rate']:.2f}/s {f.get('on_time_no_floors', '?')}/{f['streams']}"
                    for f in sorted(search_result["probes"], key=lambda f: f["rate"])
                )
                + ".",
                "",
            ]
            zero = search_result.get("zero_compute_rate")
            lines += [
                "By the zero-compute test (pauses beyond what the token input alone forces), the "
                "highest probed rate that passes: "
                + (
                    f"**{zero:.2f} streams/s = "
                    f"{search_result['zero_compute_audio_s_per_s']:.0f} audio s/s**."
                    if zero
                    else "none."
                ),
                "",
            ]
        lines += [
            "| rate /s | audio s/s offered | on time | first chunk p50 / p95 ms | excess p99 ms "
            "| xRT | concurrent | pass |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for f in sorted(search_result["probes"], key=lambda f: f["rate"]):
            lines.append(
                f"| {f['rate']:.2f} | {_fmt(f['offered_audio_s_per_s'], '.0f')} | "
                f"{f['on_time']}/{f['streams']} ({_fmt(100 * (f['on_time_share'] or 0), '.1f')} %) "
                f"| {_fmt(f['first_chunk_p50_ms'], '.0f')} / {_fmt(f['first_chunk_p95_ms'], '.0f')} "
                f"| {_fmt(f['excess_buffer_p99_ms'], '.0f')} | {_fmt(f['xrt'])} "
                f"| {_fmt(f['concurrent_streams'], '.0f')} | {'yes' if f['passed'] else 'no'} |"
            )
        lines.append("")
        stalled = [
            f for f in sorted(search_result["probes"], key=lambda f: f["rate"]) if f.get("stalled")
        ]
        if stalled:
            lines += [STALLED_LEGEND, ""]
            lines += [f"- {f['rate']:.2f}/s: {stall_line(f['stalled'])}" for f in stalled]
            lines.append("")
    if result.get("overload"):
        o = result["overload"]
        f = o["figures"]
        ref = f["refusal_ms"] or {}
        lines += [
            "## Overload (admission on)",
            "",
            f"{o['rate']:.2f} streams/s ({o['factor']:g} x capacity) for {o['duration_s']:g} s: "
            f"{f['admitted']} admitted, {f['refused']} refused; admitted on time "
            f"{f['on_time']}/{f['admitted']} "
            f"({_fmt(100 * (f['admitted_on_time_share'] or 0), '.1f')} %); refusal latency "
            f"p50 / p99 {_fmt(ref.get('p50'), '.1f')} / {_fmt(ref.get('p99'), '.1f')} ms; "
            f"first chunk p95 {_fmt(f['first_chunk_p95_ms'], '.0f')} ms.",
            "",
            f"Back to idle: **{'yes' if o['back_to_idle'] else 'NO'}**; before "
            f"`{json.dumps(o['before'])}`, after `{json.dumps(o['after'])}`.",
            "",
        ]
    if result.get("skipped"):
        lines += ["## Skipped", ""] + [f"- {s}" for s in result["skipped"]] + [""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    """On-time share and first-chunk p95 against arrival rate, capacity marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    caps = result.get("capacity", {})
    if not caps:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, sr in caps.items():
        probes = sorted(sr["probes"], key=lambda f: f["rate"])
        x = [f["offered_audio_s_per_s"] for f in probes]
        (line,) = a1.plot(x, [100 * (f["on_time_share"] or 0) for f in probes], "o-", label=key)
        a2.plot(x, [f["first_chunk_p95_ms"] or float("nan") for f in probes], "o-", label=key)
        if sr["capacity_audio_s_per_s"]:
            for ax in (a1, a2):
                ax.axvline(sr["capacity_audio_s_per_s"], color=line.get_color(), ls=":")
    a1.axhline(99, color="grey", lw=0.8)
    a2.axhline(250, color="grey", lw=0.8)
    a1.set(xlabel="offered audio s/s (Poisson)", ylabel="streams on time, %", title="on time")
    a2.set(xlabel="offered audio s/s (Poisson)", ylabel="ms", title="first chunk p95")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(title="tokens")
    fig.suptitle(f"real-time capacity, {result['dtype']} (dotted: capacity)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def elapsed_since(t0: float) -> float:
    return time.monotonic() - t0


# -- the run ----------------------------------------------------------------------------------


class CapacityStack(Stack):
    """One stack (batching on; `config.gateways` gateways) plus more gateways in front of the
    same flow and vocoder services: one with admission control on (the overload run). The
    admission gateway stays single: admission is per gateway process
    (each plans with the flow replicas' whole reported capacity and sees only its own
    streams), so N of them would each admit as if alone. Every process exposes its metrics."""

    ADMIT = "gateway.admit"

    def __init__(self, config: StackConfig, log_dir: Path, admission_args: tuple[str, ...]):
        super().__init__(config, log_dir, name="capacity")
        self.add_gateways(self.ADMIT, 1)
        self.metrics_ports = {name: free_port() for name in self.ports}
        self.admission_args = admission_args

    def commands(self) -> dict[str, list[str]]:
        cmds = super().commands()
        for name, cmd in cmds.items():
            cmd += ["--metrics-port", str(self.metrics_ports[name])]  # the last value wins
        for name in self.gateway_groups[self.ADMIT]:
            cmds[name] += ["--admission=true", *self.admission_args]
        return cmds

    def gauges_ports(self) -> dict[str, int]:
        """Module -> metrics port of the processes whose idle gauges count (the admission
        gateway stands for the gateways: the overload runs through it)."""
        return {
            "flow_service": self.metrics_ports["flow_service"],
            "vocoder_service": self.metrics_ports["vocoder_service"],
            "gateway": self.metrics_ports[self.ADMIT],
        }


def pace_key(pace: float) -> str:
    return "all at once" if pace <= 0 else f"at {pace:g}/s"


def run(a, argv: list[str]) -> dict:
    """`python -m bench capacity`: closed loop, capacity searches, overload (see the module
    docstring); writes capacity.md, capacity.json, capacity.png and the runs' JSONs."""
    t_start = time.monotonic()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if a.start_buffer_ms and len(a.start_buffer_ms) > 1:
        raise InvalidConfig(
            "start_buffer_ms", "capacity takes one value (sweep and poisson: several)"
        )
    workload = WorkloadConfig(
        a.prompt_tokens,
        a.utterance_tokens,
        0.0,
        a.seed,
        a.audio_format,
        a.schedule,
        a.mix,
        a.start_buffer_ms[0] if a.start_buffer_ms else None,
    )
    mixed = workload.mix == "mixed"
    if mixed and tuple(a.paces) != (0.0,):
        raise InvalidConfig("paces", "the mixed workload paces each stream; give --paces 0")
    utt_s = workload.mean_utterance_seconds

    def key(pace: float) -> str:
        return "as the mixed workload sends them" if mixed else pace_key(pace)

    criteria = Criteria(a.on_time_share, a.first_chunk_p95_ms)
    env = environment(argv)
    meta = {
        "dtype": a.dtype,
        "preset": a.preset,
        "device": a.device,
        "gateways": a.gateways,
        "client_procs": a.client_procs,
    }
    config = StackConfig(
        device=a.device,
        dtype=a.dtype,
        preset=a.preset,
        batching=True,
        model_dir=a.model_dir,
        flow_args=tuple(a.flow_arg),
        vocoder_args=tuple(a.vocoder_arg),
        gateway_args=tuple(a.gateway_arg),
        startup_timeout_s=a.startup_timeout,
        threads=a.threads,
        flow_replicas=a.flow_replicas,
        vocoder_replicas=a.vocoder_replicas,
        gateways=a.gateways,
    )
    result: dict = {
        **meta,
        "command": env["command"],
        "commit": env.get("commit") or "?",
        "started_at": env["date"],
        "workload": (
            f"the mixed workload (bench/workload.py: six voices of 2-8 s prompts, 1-30 s "
            f"utterances, mean {utt_s:.1f} s, three in four paced at 40-120 tokens/s in bursts)"
            if mixed
            else f"{a.prompt_tokens}-token prompt, {a.utterance_tokens}-token utterances "
            f"({utt_s:g} s)"
        )
        + f", Poisson arrivals for {a.duration:g} s per probe",
        "criteria": {"on_time_share": a.on_time_share, "first_chunk_p95_ms": a.first_chunk_p95_ms},
        "capacity": {},
        "skipped": [],
        "environment": env,
    }

    def left() -> float:
        return a.time_budget - (time.monotonic() - t_start) if a.time_budget else math.inf

    def save() -> None:
        (out / "capacity.json").write_text(json.dumps(result, indent=1))
        (out / "capacity.md").write_text(render(result))

    log(f"starting the stack ({a.device}, {a.dtype}, {a.preset}) ...")
    stack = CapacityStack(config, out / "logs", tuple(a.admission_arg))
    stack.start()
    try:
        stack.wait_ready()
    except BaseException:
        stack.stop()
        raise
    log(f"SERVING after {time.monotonic() - t_start:.1f} s")
    targets = {
        "on": Target(stack.targets(), stack),
        "admit": Target(stack.targets(stack.ADMIT), stack),
    }
    sweep_cfg = SweepConfig(
        labels=("on",),
        concurrency=(),
        warmup_streams=a.warmup_streams,
        stream_timeout_s=a.stream_timeout,
        drain_timeout_s=a.drain_timeout,
        client_procs=a.client_procs,
    )
    sweep = Sweep(sweep_cfg, workload, targets, out / "runs", env, meta, a.quiet)
    (out / "runs").mkdir(exist_ok=True)
    runs: list[dict] = []

    def one(spec: RunSpec, warm: bool) -> dict:
        sweep.cfg = replace(sweep_cfg, warmup_streams=a.warmup_streams if warm else 0)
        limit = max(30.0, min(a.drain_timeout + spec.duration_s + utt_s, left()))
        log(f"[{time.monotonic() - t_start:5.0f} s] {spec.describe()}")
        r = sweep.run_one(spec, limit)
        runs.append(r)
        pace = f"-pace{spec.pace:g}" if spec.pace > 0 else ""  # probes may share a rate
        (out / "runs" / f"{len(runs):02d}-{run_name(r)}{pace}.json").write_text(json.dumps(r))
        log("    " + one_line(r))
        return r

    try:
        warm = True
        c = a.closed_concurrency
        if c:
            r = one(RunSpec("closed", "on", c, 0.0, utterances_per_stream=1), warm)
            warm = False
            m = r["metrics"]
            fc = m["first_chunk_ms"] or {}
            result.setdefault("closed", []).append(
                {
                    "gateway": "deadlines",
                    "concurrency": c,
                    "streams": m["num_streams"],
                    "xrt": m["xrt"],
                    "first_p50": fc.get("p50"),
                    "first_p95": fc.get("p95"),
                    "stack_streams": m["underruns"]["stack_streams"],
                    "excess_p95": (m["underruns"]["excess_buffer_ms"] or {}).get("p95"),
                    "errors": m["errors"],
                    "first_stages": m["first_chunk_stages"],
                }
            )
            save()
        for pace in a.paces:
            input_s = (
                workload.longest_input_seconds
                if mixed
                else replace(workload, pace=pace).longest_input_seconds
            )
            probe_s = a.duration + max(input_s, utt_s) + 10.0
            # the overload run (after the searches) keeps its time
            reserve = a.overload_duration + utt_s + 15.0 if a.overload_duration > 0 else 0.0

            def can_probe(pace=pace, probe_s=probe_s, reserve=reserve) -> bool:
                if left() >= probe_s + reserve:
                    return True
                why = f"capacity {key(pace)}: further probes cut by the time budget"
                if why not in result["skipped"]:
                    result["skipped"].append(why)
                return False

            floors = None
            if pace > 0 and a.floor_streams > 0 and left() >= probe_s + reserve:
                # each chunk's latency through the otherwise idle stack, streams one at a time
                spec = RunSpec("closed", "on", 1, pace, utterances_per_stream=a.floor_streams)
                floors = compute_floors(one(spec, warm))
                warm = False
                log(f"compute floors {key(pace)}: {floors} ms")

            def probe(rate: float, pace=pace, floors=floors) -> dict:
                nonlocal warm
                window = max(a.duration, a.min_streams / rate)  # enough arrivals to judge
                r = one(RunSpec("open", "on", rate, pace, duration_s=window), warm)
                warm = False
                return on_time_figures(r, utt_s, floors)

            start = a.start_rate
            cap, probes = search(probe, criteria, start, a.max_rate, a.growth, a.refine, can_probe)
            conc = next((f["concurrent_streams"] for f in probes if f["rate"] == cap), None)
            result["capacity"][key(pace)] = {
                "pace": pace,
                "capacity_rate": cap,
                "capacity_audio_s_per_s": cap * utt_s if cap else None,
                "capacity_concurrent": conc,
                "compute_floors_ms": floors,
                "probes": probes,
            }
            if floors:
                zero = highest_passing_without_floors(probes, criteria)
                result["capacity"][key(pace)].update(
                    zero_compute_rate=zero,
                    zero_compute_audio_s_per_s=zero * utt_s if zero else None,
                )
            save()
            log(f"capacity {key(pace)}: {cap} streams/s")
        base = result["capacity"].get(key(0.0), {}).get("capacity_rate")
        if a.overload_duration > 0 and base:
            rate = a.overload_factor * base
            need = a.overload_duration + utt_s + 15.0
            if left() < need:
                result["skipped"].append(f"overload: {left():.0f} s left, needs ~{need:.0f}")
            else:
                before = idle_snapshot(stack.gauges_ports())
                spec = RunSpec("open", "admit", rate, 0.0, duration_s=a.overload_duration)
                r = one(spec, True)
                after = idle_snapshot(stack.gauges_ports())
                for _ in range(20):  # allow the services a moment to settle
                    if back_to_idle(before, after):
                        break
                    time.sleep(0.5)
                    after = idle_snapshot(stack.gauges_ports())
                result["overload"] = {
                    "rate": rate,
                    "factor": a.overload_factor,
                    "duration_s": a.overload_duration,
                    "figures": on_time_figures(r, utt_s),
                    "before": before,
                    "after": after,
                    "back_to_idle": back_to_idle(before, after),
                }
        elif a.overload_duration > 0:
            result["skipped"].append("overload: no capacity measured (tokens all at once)")
    finally:
        save()
        stack.stop()
    png = plot(result, out / "capacity.png")
    if png:
        log(f"plot {png}")
    return result
