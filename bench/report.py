"""Run files, the markdown results table, and the batching on/off ratios.

Every run is one JSON file in the output directory (`closed-c16-on.json`, `open-r4-on.json`),
written as soon as the run ends, and `results.md` is rewritten after each run, so a sweep cut
short still leaves everything it measured. `python -m bench report DIR...` rebuilds the table
and the plots from the run files of one or more sweeps (e.g. fp32 and bf16 together).
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import subprocess
import sys
from pathlib import Path

from bench.gpu import hardware
from bench.metrics import STACK_TOLERANCE_S, stall_post_mortem
from bench.stack import REPO_ROOT

SCHEMA = "token2wav-bench/1"


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(argv: list[str] | None = None) -> dict:
    """Hardware, versions, date and the exact command, for the report header."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"  # the numbers belong to uncommitted code, not to that commit
    argv = sys.argv[1:] if argv is None else argv
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m bench " + shlex.join(argv),
        "commit": commit or None,
        "hardware": hardware(),
    }


def run_name(run: dict) -> str:
    if run["kind"] == "closed":
        level = f"c{run['concurrency']}"
        if run["workload"]["pace"] > 0:
            level += f"-pace{run['workload']['pace']:g}"
    else:
        level = f"r{run['rate']:g}"
    if (ms := run["workload"].get("start_buffer_ms")) is not None:
        level += f"-sb{ms}"
    return f"{run['dtype']}-{run['kind']}-{level}-{run['label']}"


def write_run(out_dir: Path, run: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{run_name(run)}.json"
    path.write_text(json.dumps(run, indent=1))
    return path


def load_runs(dirs: list[str | Path]) -> list[dict]:
    runs = []
    for d in dirs:
        for path in sorted(Path(d).glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(data, dict) and data.get("schema") == SCHEMA:
                runs.append(data)
    return runs


def _f(value, fmt: str = ".0f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def _pct(stats: dict | None, key: str, fmt: str = ".0f", scale: float = 1.0) -> str:
    return "-" if not stats else _f(stats.get(key), fmt, scale)


def _level(run: dict) -> str:
    if run["kind"] == "closed":
        return str(run["concurrency"])
    return f"{run['rate']:g}/s"


def _pace(pace: float) -> str:
    return "all" if pace <= 0 else f"{pace:g}"


def _load(run: dict) -> str:
    load = "closed" if run["kind"] == "closed" else "Poisson"
    pace = run["workload"]["pace"]
    ms = run["workload"].get("start_buffer_ms")
    return (
        f"{load} {_level(run)}"
        + (f" @{pace:g} tok/s" if pace > 0 else "")
        + ("" if ms is None else f", start buffer {ms} ms")
    )


def _sort_key(run: dict):
    return (
        run["dtype"],
        run["kind"],
        run["workload"]["pace"],
        run.get("concurrency") or 0,
        run.get("rate") or 0.0,
        run["label"],
        run["workload"].get("start_buffer_ms") or 0,
    )


def results_table(runs: list[dict]) -> str:
    head = (
        "| dtype | load | pace tok/s | batching | streams | xRT | first chunk p50 / p95 / p99 ms "
        "| gap p99 ms | e2e p50 s | underrun streams (stack) | errors | flow batch | "
        "GPU MiB |\n|" + "---|" * 13 + "\n"
    )
    lines = []
    for r in sorted(runs, key=_sort_key):
        m = r["metrics"]
        fc = m["first_chunk_ms"]
        errors = ", ".join(f"{k} {v}" for k, v in sorted(m["errors"].items())) or "0"
        stages = m["stages"] or {}
        mem = r.get("gpu_memory") or {}
        mib = _f(mem.get("stack_mib"))
        if mem.get("stack_mib") is None and mem.get("device_mib") is not None:
            mib = f"{mem['device_mib']} (device)"  # PIDs not visible: every process on the GPU
        load = "closed" if r["kind"] == "closed" else "Poisson"
        u = m["underruns"]
        lines.append(
            f"| {r['dtype']} | {load} {_level(r)} | {_pace(r['workload']['pace'])} "
            f"| {r['label']} | {m['num_streams']} | {_f(m['xrt'], '.1f')} "
            f"| {_pct(fc, 'p50')} / {_pct(fc, 'p95')} / {_pct(fc, 'p99')} "
            f"| {_pct(m['inter_chunk_gap_ms'], 'p99')} | {_pct(m['e2e_ms'], 'p50', '.2f', 1e-3)} "
            f"| {u['streams']} ({u['stack_streams']}) | {errors} "
            f"| {_f(stages.get('flow_batch_size'), '.1f')} | {mib} |"
        )
    return head + "\n".join(lines) + "\n"


def stages_table(runs: list[dict]) -> str:
    """Where the first chunk's time goes (mean ms), the figure that decides time to audio."""
    head = (
        "| dtype | load | batching | flow queue | flow compute | vocoder queue | "
        "vocoder compute | gateway | wire | first chunk mean |\n|" + "---|" * 10 + "\n"
    )
    lines = []
    for r in sorted(runs, key=_sort_key):
        s = r["metrics"]["first_chunk_stages"]
        if not s:
            continue
        total = r["metrics"]["first_chunk_ms"]["mean"]
        lines.append(
            f"| {r['dtype']} | {_load(r)} | {r['label']} "
            f"| {s['flow_queue_ms']:.1f} | {s['flow_compute_ms']:.1f} "
            f"| {s['vocoder_queue_ms']:.1f} | {s['vocoder_compute_ms']:.1f} "
            f"| {s['gateway_ms']:.1f} | {s['wire_ms']:.1f} | {total:.1f} |"
        )
    return head + "\n".join(lines) + "\n"


def playback_table(runs: list[dict]) -> str:
    """Underruns of a player that starts at the first chunk, and the buffers that avoid them."""
    head = (
        "| dtype | load | batching | underrun streams | stalls | silence s | buffer needed "
        "p50 / p95 ms | forced by input p95 ms | added by stack p95 / max ms | stack "
        "streams |\n|" + "---|" * 10 + "\n"
    )
    lines = []
    for r in sorted(runs, key=_sort_key):
        u = r["metrics"]["underruns"]
        ex = u.get("excess_buffer_ms")
        lines.append(
            f"| {r['dtype']} | {_load(r)} | {r['label']} | {u['streams']} | {u['events']} "
            f"| {u['stall_s']:.2f} | {_pct(u.get('buffer_ms'), 'p50')} / "
            f"{_pct(u.get('buffer_ms'), 'p95')} | {_pct(u.get('input_buffer_ms'), 'p95')} "
            f"| {_pct(ex, 'p95')} / {_pct(ex, 'max')} | {u['stack_streams']} |"
        )
    return head + "\n".join(lines) + "\n"


def stalled_lines(runs: list[dict]) -> list[str]:
    """Per run with stack-stalled streams: the chunk that set each stall and its stages."""
    lines = []
    for r in sorted(runs, key=_sort_key):
        stalled = [
            s
            for s in r.get("streams", [])
            if s.get("status") == "OK" and s.get("excess_buffer_ms", 0.0) > STACK_TOLERANCE_S * 1e3
        ]
        if pm := stall_post_mortem(stalled):
            lines.append(f"- {r['dtype']}, {_load(r)}, {r['label']}: {stall_line(pm)}")
    return lines


# What `stall_line` says, once above its lines (results.md, capacity.md).
STALLED_LEGEND = (
    "Stalled streams: the chunk that sets each stall (by seq; medians over the streams): its "
    "latency against the stream's first chunk's, then ms of flow queue + compute (rows), "
    "vocoder queue + compute (rows), gateway total."
)


def stall_line(st: dict) -> str:
    """One line of `bench.metrics.stall_post_mortem`'s figures."""
    chunks = ", ".join(f"{k}: {n}" for k, n in st["chunk"].items())
    streams = f"{st['streams']} stream" + ("" if st["streams"] == 1 else "s")
    return (
        f"{streams} (chunk {chunks}); {st['latency_ms']:.0f} ms against "
        f"{st['first_chunk_latency_ms']:.0f}; flow {st['flow_queue_ms']:.0f} + "
        f"{st['flow_compute_ms']:.0f} ({st['flow_batch_size']:.0f}), vocoder "
        f"{st['vocoder_queue_ms']:.0f} + {st['vocoder_compute_ms']:.0f} "
        f"({st['vocoder_batch_size']:.0f}), gateway {st['gateway_ms']:.0f}"
    )


def batching_ratios(runs: list[dict]) -> list[dict]:
    """On/off pairs measured on the same workload: xRT on / off, latency off / on (>1: on is
    better in both)."""
    by_key: dict[tuple, dict[str, dict]] = {}  # (dtype, kind, pace, level) -> label -> run
    for r in runs:
        if r.get("batching") is None:
            continue
        key = (r["dtype"], r["kind"], r["workload"]["pace"], r.get("concurrency"), r.get("rate"))
        by_key.setdefault(key, {})[r["label"]] = r
    out = []
    for key, pair in sorted(by_key.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        if "on" not in pair or "off" not in pair:
            continue
        on, off = pair["on"]["metrics"], pair["off"]["metrics"]

        def ratio(a, b):
            return a / b if a is not None and b not in (None, 0) else None

        def p(stats, k):
            return stats[k] if stats else None

        out.append(
            {
                "dtype": key[0],
                "kind": key[1],
                "pace": key[2],
                "level": _level(pair["on"]),
                "xrt": ratio(on["xrt"], off["xrt"]),
                "first_chunk_p50": ratio(
                    p(off["first_chunk_ms"], "p50"), p(on["first_chunk_ms"], "p50")
                ),
                "first_chunk_p95": ratio(
                    p(off["first_chunk_ms"], "p95"), p(on["first_chunk_ms"], "p95")
                ),
            }
        )
    return out


def ratios_table(ratios: list[dict]) -> str:
    if not ratios:
        return "(no level was measured with batching both on and off)\n"
    head = (
        "| dtype | load | pace tok/s | xRT on/off | first chunk p50 off/on | p95 off/on |\n|"
        + "---|" * 6
        + "\n"
    )
    lines = [
        f"| {x['dtype']} | {x['kind']} {x['level']} | {_pace(x['pace'])} "
        f"| {_f(x['xrt'], '.2f')}x | {_f(x['first_chunk_p50'], '.2f')}x "
        f"| {_f(x['first_chunk_p95'], '.2f')}x |"
        for x in ratios
    ]
    return head + "\n".join(lines) + "\n"


def _hardware_line(env: dict) -> str:
    hw = env.get("hardware") or {}
    gpus = hw.get("gpus") or []
    gpu = ", ".join(f"{g['name']} ({g['memory_mib']} MiB, driver {g['driver']})" for g in gpus)
    return (
        f"{gpu or 'no GPU'}; CPU {hw.get('cpu')} x{hw.get('cpu_cores')}; "
        f"Python {hw.get('python')}, torch {hw.get('torch')} (CUDA {hw.get('cuda')})"
    )


def render(env: dict, runs: list[dict], skipped: list[str] | None = None) -> str:
    """results.md: header, main table, first-chunk stages, on/off ratios."""
    dtypes = sorted({r["dtype"] for r in runs})
    presets = sorted({r["preset"] for r in runs})
    sweeps = env.get("sweeps") or [env]  # `report` merges the environments of several sweeps
    parts = [
        "# token2wav benchmark results\n",
        f"- date: {', '.join(sorted({s['date'] for s in sweeps}))}",
        f"- hardware: {_hardware_line(sweeps[0])}",
        f"- preset: {', '.join(presets) or '-'}; dtype: {', '.join(dtypes) or '-'}",
        f"- commit: {', '.join(sorted({s.get('commit') or 'unknown' for s in sweeps}))}",
        *[f"- command: `{s['command']}`" for s in sweeps],
        "",
        "## Results\n",
        "xRT: audio seconds per wall second over the measured window. Latencies are client-side "
        "(first chunk: from the moment the first chunk's tokens were all sent). Underrun "
        "streams: streams whose playback stalled at least once; in brackets, those that would "
        "stall even with the start buffer the token input forces (see Playback). Flow batch: "
        "mean requests per solver batch seen by the chunks. GPU MiB: peak of the "
        "stack's processes, or of the whole device (both stacks) where nvidia-smi hides PIDs.\n",
        results_table(runs),
        "## First chunk: where the time goes (mean ms)\n",
        stages_table(runs),
        "## Playback\n",
        "A player that starts when the first chunk arrives and pauses when it runs dry. Buffer "
        "needed: the start delay that would have avoided every pause. Forced by input: the same "
        "for a stack that answers instantly (tokens fed at 25/s force it: the hop doubles). "
        "Stack streams: streams whose needed buffer exceeds the input's by more than 20 ms.\n",
        playback_table(runs),
    ]
    if stalled := stalled_lines(runs):
        parts += [STALLED_LEGEND + "\n", *stalled, ""]
    parts += [
        "## Batching on vs off\n",
        ratios_table(batching_ratios(runs)),
    ]
    if skipped:
        parts += ["## Skipped\n", *[f"- {s}" for s in skipped], ""]
    return "\n".join(parts)


def load_environments(dirs: list[str | Path]) -> list[dict]:
    envs = []
    for d in dirs:
        try:
            envs.append(json.loads((Path(d) / "environment.json").read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return envs


def write_results(out_dir: Path, env: dict, runs: list[dict], skipped=None) -> Path:
    """results.md, environment.json, and bench.json (everything: environment, skipped runs,
    every run with its streams) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "environment.json").write_text(json.dumps(env, indent=1))
    everything = {"environment": env, "skipped": skipped or [], "runs": runs}
    (out_dir / "bench.json").write_text(json.dumps(everything))
    path = out_dir / "results.md"
    path.write_text(render(env, runs, skipped))
    return path
