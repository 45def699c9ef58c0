"""`python -m bench`: the token2wav load generator and benchmark.

  python -m bench sweep --concurrency 1,2,4,8,16,32,64 --utterances-per-stream 2 --pace 0 \\
      --batching on,off --device cuda --dtype bfloat16 --preset cosyvoice3-0.5b --out-dir DIR
  python -m bench poisson --rates 1,2,4,8 --duration 30 --device cuda ... --out-dir DIR
  python -m bench sweep --target HOST:PORT --label mine ...   # drive a gateway you started
  python -m bench smoke [--out-dir DIR]                         # CPU, small preset, seconds
  python -m bench report DIR [DIR ...] --out-dir DIR            # one table + plots from sweeps
  python -m bench capacity --device cuda --dtype bfloat16 --preset cosyvoice3-0.5b \
      --paces 0,50 --closed-concurrency 64 --out-dir DIR        # real-time capacity (bench/capacity.py)
  python -m bench flow-model --batches 1,4 ...                  # one part alone: see the list below

Without --target it starts its own stacks (flow, vocoder, gateway as subprocesses; one per
batching mode, side by side) and stops them at the end. --gateways N starts N gateways per
stack (a deployment's replicas behind a load balancer) and --client-procs K drives the load
from K processes (a client population, not one event loop); streams go round robin. Each run
writes DIR/<run>.json, DIR/results.md is rewritten after every run, and plots (PNG) come at the
end when matplotlib is installed. docs/BENCHMARKS.md explains every figure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.args import at_least
from bench.plots import plot_all
from bench.report import environment, load_environments, load_runs, write_results
from bench.stack import StackConfig, StackError, start_stacks
from bench.sweep import Sweep, SweepConfig, Target, consistency_problems, plan
from bench.workload import InvalidConfig, WorkloadConfig


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated numbers, got {text!r}") from None


def _labels(text: str) -> tuple[str, ...]:
    labels = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in labels if x not in ("on", "off")]
    if bad or len(set(labels)) != len(labels):
        raise argparse.ArgumentTypeError(f"want on, off or on,off, got {text!r}")
    return labels


_count = at_least(1)


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("stack (ignored with --target)")
    g.add_argument(
        "--target",
        default="",
        help="drive this gateway HOST:PORT (or several, comma-separated: streams round robin), "
        "start nothing",
    )
    g.add_argument("--label", default="external", help="name of the --target runs")
    g.add_argument("--device", default="cpu", help="torch device of flow and vocoder")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument(
        "--vocoder-dtype",
        default="",
        choices=["", "float32", "bfloat16"],
        help="the vocoder's dtype when it differs from --dtype (e.g. bf16 flow, fp32 HiFT)",
    )
    g.add_argument(
        "--preset",
        default="",
        help="model preset: small or cosyvoice3-0.5b (default: the full-size "
        "cosyvoice3-0.5b on a CUDA --device, small on the CPU)",
    )
    g.add_argument("--model-dir", default="", help="official flow.pt/hift.pt; empty: random")
    g.add_argument("--batching", type=_labels, default=("on", "off"), help="on, off or on,off")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="s to get SERVING")
    g.add_argument(
        "--flow-replicas", type=_count, default=1, help="flow processes behind the gateways"
    )
    g.add_argument("--vocoder-replicas", type=_count, default=1, help="vocoder processes")
    g.add_argument(
        "--gateways",
        type=_count,
        default=1,
        help="gateway processes in front of the same flow and vocoder replicas, as a deployment "
        "runs several behind a load balancer; the load generator spreads streams over them "
        "round robin (one gateway is one Python event loop for all of its streams)",
    )
    for svc in ("flow", "vocoder", "gateway"):
        g.add_argument(
            f"--{svc}-arg",
            action="append",
            default=[],
            metavar="FLAG",
            help=f"extra flag for the {svc} service, repeatable (--{svc}-arg=--max-wait-ms=2)",
        )
    w = p.add_argument_group("workload")
    w.add_argument("--prompt-tokens", type=int, default=75, help="voice prompt (3 s = 75)")
    w.add_argument("--utterance-tokens", type=int, default=250, help="utterance (10 s = 250)")
    w.add_argument("--pace", type=float, default=0.0, help="tokens/s per stream; 0: all at once")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--audio-format", default="pcm16", choices=["pcm16", "float32"])
    w.add_argument(
        "--schedule",
        default="upstream",
        choices=["upstream", "blocks"],
        help="chunk schedule each stream asks for (StreamConfig)",
    )
    w.add_argument(
        "--mix",
        default="uniform",
        choices=["uniform", "mixed"],
        help="uniform: every stream as the flags above say; mixed: six voices of 2-8 s "
        "prompts, 1-30 s utterances, three in four paced at 40-120 tokens/s in bursts "
        "(bench/workload.py), whatever --prompt-tokens, --utterance-tokens and --pace say",
    )
    w.add_argument(
        "--start-buffer-ms",
        type=_ints,
        default=None,
        help="StreamConfig.start_buffer_ms of every stream (default: unset, the gateway's "
        "--start-buffer-ms); sweep and poisson take a comma list and run each level once per "
        "value on the same stack (0,200: an A/B of buffers); capacity takes one",
    )
    w.add_argument("--warmup-streams", type=int, default=4, help="per run, not measured")
    w.add_argument("--stream-timeout", type=float, default=600.0, help="deadline per stream, s")
    w.add_argument(
        "--client-procs",
        type=_count,
        default=1,
        help="load-generator processes, each with its own event loop and its share of a run's "
        "streams (closed loop: workers; open loop: arrivals, each process Poisson at "
        "rate/K), all started on one clock; a client population is not one event loop",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default="out/bench", help="run JSONs, results.md, plots, logs")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="s; skip runs whose estimate (from the xRT measured so far) would overrun it",
    )


# Subcommands that are parts with flags of their own: `python -m bench NAME ARGS` calls
# MODULE.FUNCTION(ARGS) (FUNCTION: main unless named), so `python -m bench NAME --help` shows
# that part's flags. The parts that time one model or one service share their flags, timing
# loop and JSON record (bench/parts.py).
TOOLS: dict[str, tuple[str, str]] = {
    "flow-model": ("bench.flow_model", "Stage-1 flow model alone: exactness and batch timing"),
    "kernels": ("bench.flow_kernels:main", "DiT kernel variants: time, MFU, exactness"),
    "profile-batch": ("bench.flow_profile:profile_batch", "torch profiler trace of one flow batch"),
    "profile-prefix": (
        "bench.flow_profile:profile_prefix",
        "flow calls of one utterance: eager, eager + cache, CUDA graphs",
    ),
    "flow-service": ("bench.flow_service_bench", "flow_service alone over gRPC, batching on/off"),
    "prefix-cache": ("bench.prefix_cache_bench", "flow prefix cache on/off: work and throughput"),
    "hift-model": ("bench.vocoder_model", "Stage-2 HiFT model alone: exactness and timing"),
    "vocoder-latency": (
        "bench.vocoder_model:latency_main",
        "vocoder batch latency, graphs off/on",
    ),
    "vocoder-service": ("bench.vocoder_service_bench", "vocoder_service alone over gRPC"),
    "upstream-compare": ("bench.upstream_compare", "SNR against upstream CosyVoice3's code"),
    "audio-formats": ("bench.audio_formats", "what each output format costs per stream"),
    "gateway-overhead": ("bench.gateway_overhead", "what the gateway adds when models are free"),
    "simulate": ("bench.simulate", "discrete-event simulation of the scheduling, no GPU"),
    "soak": ("bench.soak", "bounded fault-injecting soak of the whole stack"),
    "rolling": ("bench.rolling", "what a rolling update of each kind costs the streams on it"),
}


def run_tool(name: str, argv: list[str]) -> int:
    """The exit status of `python -m bench NAME ARGV`: the part's int, else 0; argparse's on
    --help or a bad flag."""
    module, _, function = TOOLS[name][0].partition(":")
    entry = getattr(importlib.import_module(module), function or "main")
    saved = sys.argv
    sys.argv = [f"python -m bench {name}", *argv]  # argparse names the program from argv[0]
    try:
        code = entry(argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return code if isinstance(code, int) else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="closed-loop concurrency sweep (and optional extras)")
    _add_common(s)
    s.add_argument("--concurrency", type=_ints, default=(1, 2, 4, 8, 16, 32, 64))
    s.add_argument("--utterances-per-stream", type=int, default=2, help="K per closed-loop worker")
    s.add_argument(
        "--max-utterances-per-level", type=int, default=0, help="cap on C x K (K >= 1); 0: none"
    )
    s.add_argument(
        "--off-concurrency", type=_ints, default=None, help="levels for batching off (default all)"
    )
    s.add_argument(
        "--paced-concurrency",
        type=_ints,
        default=(),
        help="extra closed-loop levels with tokens fed at --paced-rate",
    )
    s.add_argument("--paced-rate", type=float, default=25.0, help="tokens/s of the paced levels")
    s.add_argument("--rates", type=_floats, default=(), help="also Poisson runs at these rates")
    s.add_argument("--duration", type=float, default=30.0, help="Poisson arrival window, s")
    s.add_argument("--off-rates", type=_floats, default=None)
    s.add_argument("--run-timeout", type=float, default=600.0, help="closed loop: s per run")
    s.add_argument("--drain-timeout", type=float, default=120.0, help="open loop: s after arrivals")

    po = sub.add_parser("poisson", help="open-loop Poisson arrivals at stepped rates")
    _add_common(po)
    po.add_argument("--rates", type=_floats, default=(1, 2, 4, 8), help="streams/s")
    po.add_argument("--duration", type=float, default=30.0, help="arrival window per rate, s")
    po.add_argument("--off-rates", type=_floats, default=None, help="rates for batching off")
    po.add_argument("--drain-timeout", type=float, default=120.0, help="s after the last arrival")

    sm = sub.add_parser("smoke", help="CPU, small preset, a few seconds: does the harness work")
    sm.add_argument("--out-dir", default="", help="default: a temporary directory")
    sm.add_argument("--quiet", action="store_true")

    ca = sub.add_parser(
        "capacity",
        help="real-time capacity: closed loop, Poisson rate search per pace, overload "
        "(bench/capacity.py defines on time and capacity)",
    )
    _add_common(ca)
    ca.add_argument("--paces", type=_floats, default=(0.0, 50.0), help="tokens/s; 0: all at once")
    ca.add_argument("--duration", type=float, default=15.0, help="Poisson window per probe, s")
    ca.add_argument(
        "--min-streams", type=int, default=30, help="a probe's window grows to expect this many"
    )
    ca.add_argument("--start-rate", type=float, default=4.0, help="first probed streams/s")
    ca.add_argument("--max-rate", type=float, default=64.0, help="highest streams/s probed")
    ca.add_argument("--growth", type=float, default=1.5, help="rate factor per step up")
    ca.add_argument("--refine", type=int, default=2, help="bisections after the first failure")
    ca.add_argument("--on-time-share", type=float, default=0.99)
    ca.add_argument(
        "--floor-streams",
        type=int,
        default=3,
        help="per paced search, streams run one at a time first: the median latency of each "
        "chunk through the idle stack is its compute floor in the on-time test (0: none)",
    )
    ca.add_argument("--first-chunk-p95-ms", type=float, default=250.0)
    ca.add_argument(
        "--closed-concurrency", type=int, default=64, help="closed-loop streams first; 0: none"
    )
    ca.add_argument("--overload-factor", type=float, default=2.0, help="x the capacity")
    ca.add_argument("--overload-duration", type=float, default=20.0, help="s; 0: no overload")
    ca.add_argument(
        "--admission-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for the admission gateway of the overload run, repeatable",
    )
    ca.add_argument("--drain-timeout", type=float, default=60.0, help="s after the last arrival")
    ca.add_argument("--threads", type=int, default=0, help="OMP threads per service; 0: inherit")

    for name, (_, text) in TOOLS.items():
        sub.add_parser(name, help=f"{text} (flags: python -m bench {name} --help)", add_help=False)
    r = sub.add_parser("report", help="results.md and plots from the run JSONs of sweeps")
    r.add_argument("dirs", nargs="+", help="sweep output directories")
    r.add_argument("--out-dir", required=True)
    return p


def _sweep_config(a: argparse.Namespace) -> SweepConfig:
    common = dict(
        labels=(a.label,) if a.target else a.batching,
        rates=a.rates,
        off_rates=a.off_rates,
        duration_s=a.duration,
        warmup_streams=a.warmup_streams,
        stream_timeout_s=a.stream_timeout,
        drain_timeout_s=a.drain_timeout,
        time_budget_s=a.time_budget,
        client_procs=a.client_procs,
        start_buffers=a.start_buffer_ms or (None,),
    )
    if a.cmd == "poisson":
        return SweepConfig(concurrency=(), **common)
    return SweepConfig(
        concurrency=a.concurrency,
        off_concurrency=getattr(a, "off_concurrency", None),
        utterances_per_stream=a.utterances_per_stream,
        max_utterances_per_level=a.max_utterances_per_level,
        paced_concurrency=a.paced_concurrency,
        paced_rate=a.paced_rate,
        run_timeout_s=a.run_timeout,
        **common,
    )


def run_benchmark(
    a: argparse.Namespace, argv: list[str] | None, threads: int = 0
) -> tuple[list[dict], Path]:
    cfg = _sweep_config(a)
    workload = WorkloadConfig(
        a.prompt_tokens, a.utterance_tokens, a.pace, a.seed, a.audio_format, a.schedule, a.mix
    )
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(argv)
    specs = plan(cfg, workload.pace)
    # With --target these describe the external stack only as far as the flags say.
    meta = {
        "dtype": a.dtype,
        "vocoder_dtype": a.vocoder_dtype or a.dtype,
        "preset": a.preset,
        "device": a.device,
    }
    if not a.target:
        meta.update(flow_replicas=a.flow_replicas, vocoder_replicas=a.vocoder_replicas)
    if a.target:
        targets = {a.label: Target([t.strip() for t in a.target.split(",") if t.strip()])}
        stacks = []
    else:
        configs = [
            StackConfig(
                device=a.device,
                dtype=a.dtype,
                vocoder_dtype=a.vocoder_dtype,
                preset=a.preset,
                batching=label == "on",
                model_dir=a.model_dir,
                flow_args=tuple(a.flow_arg),
                vocoder_args=tuple(a.vocoder_arg),
                gateway_args=tuple(a.gateway_arg),
                startup_timeout_s=a.startup_timeout,
                threads=threads,
                flow_replicas=a.flow_replicas,
                vocoder_replicas=a.vocoder_replicas,
                gateways=a.gateways,
            )
            for label in cfg.labels
        ]
        t = time.monotonic()
        print(
            f"starting {len(configs)} stack(s) ({a.device}, {a.dtype}, {a.preset}) ...",
            file=sys.stderr,
            flush=True,
        )
        stacks = start_stacks(configs, out / "logs")
        print(f"stacks SERVING after {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
        targets = {s.config.label: Target(s.targets(), s) for s in stacks}
    try:
        runs = Sweep(cfg, workload, targets, out, env, meta, a.quiet).run_all(specs)
    finally:
        for s in stacks:
            try:
                s.stop()
            except Exception as exc:  # noqa: BLE001 - one stack's trouble must not strand the rest
                print(f"stopping {s.name}: {exc}", file=sys.stderr)
    for path in plot_all(runs, out):
        print(f"plot {path}", file=sys.stderr)
    return runs, out


def smoke(out_dir: str, quiet: bool = False) -> tuple[list[dict], list[str]]:
    """Both batching modes at 1 and 2 streams, a paced level and a short Poisson run, on CPU
    with the small preset and 2.4 s utterances: every code path, a few seconds of compute."""
    argv = [
        "sweep",
        "--device=cpu",
        "--preset=small",
        "--concurrency=1,2",
        "--utterances-per-stream=2",
        "--max-utterances-per-level=2",
        "--paced-concurrency=2",
        "--paced-rate=100",
        "--rates=3",
        "--duration=1",
        "--off-rates=",
        "--utterance-tokens=60",
        "--warmup-streams=1",
        "--startup-timeout=180",
        "--stream-timeout=120",
        f"--out-dir={out_dir}",
        *(["--quiet"] if quiet else []),
    ]
    a = parse_args(argv)
    runs, _ = run_benchmark(a, argv, threads=1)
    problems = [p for run in runs for p in consistency_problems(run)]
    return runs, problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    if getattr(a, "preset", None) == "":
        # a GPU figure is one of the full-size model: the small one on a GPU times the harness
        a.preset = "cosyvoice3-0.5b" if a.device.startswith("cuda") else "small"
    return a


def _skipped(out_dir: str) -> list[str]:
    try:
        return json.loads((Path(out_dir) / "bench.json").read_text()).get("skipped", [])
    except (OSError, ValueError):
        return []


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in TOOLS:
        return run_tool(args[0], args[1:])
    a = parse_args(argv)
    # SIGTERM (a job's time limit, `timeout`) unwinds like Ctrl-C, so the stacks we started are
    # stopped by the `finally` blocks instead of being left running, holding ports and GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if a.cmd == "report":
            runs = load_runs(a.dirs)
            env = environment(argv)
            env["sweeps"] = load_environments(a.dirs) or [dict(env)]
            skipped = [s for d in a.dirs for s in _skipped(d)]
            path = write_results(Path(a.out_dir), env, runs, skipped)
            plots = plot_all(runs, a.out_dir)
            print(path.read_text())
            print(f"{len(runs)} runs; wrote {path} and {len(plots)} plots")
            return 0 if runs else 1
        if a.cmd == "capacity":
            from bench.capacity import run as capacity

            argv = sys.argv[1:] if argv is None else argv
            result = capacity(a, argv)
            print((Path(a.out_dir) / "capacity.md").read_text())
            return 0 if result.get("capacity") or result.get("closed") else 1
        if a.cmd == "smoke":
            out_dir = a.out_dir or tempfile.mkdtemp(prefix="bench-smoke-")
            runs, problems = smoke(out_dir, a.quiet)
            print((Path(out_dir) / "results.md").read_text())
            for p in problems:
                print(f"INCONSISTENT: {p}", file=sys.stderr)
            print(f"smoke: {len(runs)} runs, {len(problems)} problems; output in {out_dir}")
            return 1 if problems or not runs else 0
        runs, out = run_benchmark(a, argv)
        print((out / "results.md").read_text())
        return 0 if runs else 1
    except (InvalidConfig, StackError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
