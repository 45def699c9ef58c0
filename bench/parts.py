"""What every `python -m bench` part that times one model or one service shares, stated once:
its flags, its timing loop and its JSON record.

A part (flow-model, kernels, hift-model, ...) builds its parser with `parser()`, which gives it
--device, --dtype, --preset, --model-dir, --seed, --repeats, --warmup, --out and --smoke with
the part's own defaults; `parse()` applies --smoke (CPU, small preset, the part's smallest
sizes; flags given on the command line still win) and checks the device. It times with
`measure()`: untimed warm-up calls, then the repeats, each CUDA-synchronised (CUDA events
where the part asks for the GPU's time alone), summarised as min/median/p90/max. `save()`
writes the part's results to OUT/<part>.json with the environment (command, commit, date,
hardware) beside them, after every section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.report import environment
from token2wav.dtypes import DTYPES

PRESET = "cosyvoice3-0.5b"
# Short names the parts use as JSON keys (fp32/bf16), for the dtypes the services take.
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
SMOKE = {"device": "cpu", "preset": "small", "repeats": 1, "warmup": 0}


def _dtype_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    long = {v: k for k, v in SHORT.items()}
    bad = [x for x in names if x not in DTYPES and x not in long]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"want float32, bfloat16 (or fp32, bf16), comma-separated, got {text!r}"
        )
    return [long.get(x, x) for x in names]


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None


def parser(
    name: str,
    doc: str,
    *,
    dtype: str = "bfloat16",
    device: str = "cuda",
    repeats: int = 3,
    warmup: int = 1,
    smoke: dict[str, Any] | None = None,
) -> argparse.ArgumentParser:
    """The part's parser with the shared flags. `dtype` may be a comma list (the part times
    each); `smoke` holds the part's own --smoke sizes, over SMOKE."""
    p = argparse.ArgumentParser(
        prog=f"python -m bench {name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("shared by every part")
    g.add_argument("--device", default=device, help=f"torch device (default {device})")
    g.add_argument(
        "--dtype",
        type=_dtype_list,
        default=_dtype_list(dtype),
        help=f"compute dtype(s), comma-separated where the part times several (default {dtype})",
    )
    g.add_argument(
        "--preset", default=PRESET, help=f"model size (default {PRESET}; small: a smoke run)"
    )
    g.add_argument(
        "--model-dir",
        default="",
        help="official flow.pt / hift.pt directory; empty: random weights seeded by --seed",
    )
    g.add_argument("--seed", type=int, default=0, help="weights (when random) and inputs")
    g.add_argument("--repeats", type=int, default=repeats, help="timed calls per measurement")
    g.add_argument("--warmup", type=int, default=warmup, help="untimed calls before them")
    g.add_argument(
        "--out",
        default=os.environ.get("OUT") or "out/parts",
        help="folder for the part's JSON record (default $OUT, else out/parts)",
    )
    g.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, small preset, the smallest sizes: a logic check in seconds, not a measurement",
    )
    p.set_defaults(smoke_overrides={**SMOKE, **(smoke or {})}, part=name)
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    if a.smoke:
        p.set_defaults(**a.smoke_overrides)
        a = p.parse_args(argv)
    if a.repeats < 1 or a.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA device here (--smoke runs on the CPU)")
    a.model_dir = a.model_dir or None
    a.environment = environment([a.part, *argv])
    return a


def one_dtype(p: argparse.ArgumentParser, a: argparse.Namespace) -> str:
    """The part's single --dtype (parts that run one)."""
    if len(a.dtype) != 1:
        p.error(f"--dtype: this part runs one dtype, got {','.join(a.dtype)}")
    return a.dtype[0]


def config(a: argparse.Namespace) -> dict:
    """The part's flags, for its record."""
    skip = {"out", "environment", "smoke_overrides"}
    return {k: v for k, v in vars(a).items() if k not in skip}


def record(a: argparse.Namespace, **fields) -> dict:
    """A part's JSON record: when, the command, the device, torch and the flags, then `fields`."""
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.machine()
    return dict(
        date=a.environment["date"],
        command=a.environment["command"],
        device=device,
        torch=torch.__version__,
        config=config(a),
        **fields,
    )


def sync(device: str | torch.device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_tf32(on: bool) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return {"matmul.allow_tf32": on, "cudnn.allow_tf32": on}


def cpu_threads(device: str) -> None:
    """A CPU run takes at most 4 threads: the parts' CPU runs are checks, not a CPU figure."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@dataclass
class Timing:
    """ms of the timed calls; `first_ms` is the first warm-up call's (compiles, allocator,
    graph capture on a path's first use), `out` the last call's result."""

    ms: list[float]
    first_ms: float | None = None
    out: Any = field(default=None, repr=False)

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    @property
    def min(self) -> float:
        return min(self.ms)

    @property
    def max(self) -> float:
        return max(self.ms)

    @property
    def p90(self) -> float:
        s = sorted(self.ms)
        return s[min(len(s) - 1, int(0.9 * len(s)))]

    def summary(self) -> dict:
        return {
            "min_ms": self.min,
            "median_ms": self.median,
            "max_ms": self.max,
            "repeats": len(self.ms),
        }


def measure(
    fn: Callable[[Any], Any],
    device: str | torch.device,
    *,
    repeats: int,
    warmup: int = 0,
    setup: Callable[[], Any] | None = None,
    events: bool = False,
) -> Timing:
    """Call fn(setup()) `warmup` times untimed, then `repeats` times timed (setup() is outside
    the time). Each call is wall time between two device synchronisations; with `events` on
    CUDA it is the GPU time between two events on the current stream instead (one DiT call,
    whose host-side launch would otherwise count)."""
    cuda = torch.device(device).type == "cuda"
    use_events = events and cuda
    times: list[float] = []
    first, out = None, None
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        sync(device)
        if use_events:
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn(arg)
        if use_events:
            stop.record()
            stop.synchronize()
            ms = start.elapsed_time(stop)
        else:
            sync(device)
            ms = (time.perf_counter() - t0) * 1e3
        if i == 0 and warmup:
            first = ms
        if i >= warmup:
            times.append(ms)
    return Timing(times, first, out)


def once(fn: Callable[[], Any], device: str | torch.device) -> tuple[Any, float]:
    """(fn(), ms) of one synchronised call."""
    t = measure(lambda _: fn(), device, repeats=1)
    return t.out, t.ms[0]


def save(a: argparse.Namespace, data: dict, name: str) -> Path:
    """Write `data` and the environment to OUT/<name>.json."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**data, "environment": a.environment}, indent=1))
    return path
