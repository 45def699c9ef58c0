"""PNG plots of a sweep (matplotlib, Agg backend), skipped when matplotlib is not installed
(`pip install .[bench]` brings it; CI and the smoke test do without).

  first_chunk_cdf_<dtype>.png   first-chunk latency CDF, one line per concurrency, on vs off
  xrt_vs_concurrency.png        audio s per wall s against concurrency, on vs off, per dtype
  first_chunk_p95_vs_concurrency.png
  open_loop_first_chunk_p95.png Poisson runs: p95 first chunk against arrival rate
  open_loop_xrt.png             Poisson runs: xRT against arrival rate
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

_STYLE = {"on": "-", "off": "--"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(runs: list[dict], kind: str) -> dict[tuple, list[dict]]:
    """(dtype, pace, label) -> runs sorted by level."""
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["kind"] == kind:
            out.setdefault((r["dtype"], r["workload"]["pace"], r["label"]), []).append(r)
    level = "concurrency" if kind == "closed" else "rate"
    return {k: sorted(v, key=lambda r: r[level]) for k, v in sorted(out.items())}


def _name(dtype: str, pace: float, label: str) -> str:
    return f"{dtype}, batching {label}" + (f", {pace:g} tok/s" if pace > 0 else "")


def _first_chunk_cdfs(plt, runs: list[dict], out_dir: Path) -> list[Path]:
    paths = []
    for dtype in sorted({r["dtype"] for r in runs}):
        closed = [r for r in runs if r["kind"] == "closed" and r["dtype"] == dtype]
        if not closed:
            continue
        levels = sorted({r["concurrency"] for r in closed})
        colors = plt.cm.viridis(np.linspace(0, 0.9, len(levels)))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in sorted(closed, key=lambda r: (r["workload"]["pace"], r["concurrency"])):
            lat = np.sort([s["first_chunk_ms"] for s in r["streams"] if "first_chunk_ms" in s])
            if lat.size == 0:
                continue
            pace = r["workload"]["pace"]
            ax.step(
                np.concatenate([lat[:1], lat]),  # start at 0: nothing arrived before the first
                np.arange(lat.size + 1) / lat.size,
                where="post",
                linestyle=_STYLE.get(r["label"], ":") if pace <= 0 else ":",
                color=colors[levels.index(r["concurrency"])],
                label=f"{r['concurrency']} streams, {r['label']}"
                + (f", {pace:g} tok/s" if pace > 0 else ""),
            )
        ax.set_xscale("log")
        ax.set_xlabel("first-chunk latency (ms)")
        ax.set_ylabel("fraction of streams")
        ax.set_title(f"First-chunk latency CDF ({dtype}; solid: batching on, dashed: off)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        path = out_dir / f"first_chunk_cdf_{dtype}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _against_level(plt, runs, kind, metric, ylabel, title, path) -> Path | None:
    series = _series(runs, kind)
    if not series:
        return None
    level = "concurrency" if kind == "closed" else "rate"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = sorted({(dtype, pace) for dtype, pace, _ in series})  # one colour each, on and off
    for (dtype, pace, label), rs in series.items():
        pts = [(r[level], metric(r["metrics"])) for r in rs]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(
                xs,
                ys,
                _STYLE.get(label, ":"),
                marker="o",
                color=f"C{groups.index((dtype, pace)) % 10}",
                label=_name(dtype, pace, label),
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams" if kind == "closed" else "arrivals (streams/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _p(key: str, q: str):
    return lambda m: m[key][q] if m.get(key) else None


def plot_all(runs: list[dict], out_dir: str | Path) -> list[Path]:
    """Write every plot the runs allow; [] when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        logger.info("matplotlib not installed: no plots (pip install '.[bench]')")
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = _first_chunk_cdfs(plt, runs, out)
    for made in (
        _against_level(
            plt,
            runs,
            "closed",
            lambda m: m["xrt"],
            "audio s per wall s (xRT)",
            "Throughput against concurrency",
            out / "xrt_vs_concurrency.png",
        ),
        _against_level(
            plt,
            runs,
            "closed",
            _p("first_chunk_ms", "p95"),
            "first-chunk latency p95 (ms)",
            "First-chunk latency p95 against concurrency",
            out / "first_chunk_p95_vs_concurrency.png",
        ),
        _against_level(
            plt,
            runs,
            "open",
            _p("first_chunk_ms", "p95"),
            "first-chunk latency p95 (ms)",
            "Poisson arrivals: first-chunk latency p95",
            out / "open_loop_first_chunk_p95.png",
        ),
        _against_level(
            plt,
            runs,
            "open",
            lambda m: m["xrt"],
            "audio s per wall s (xRT)",
            "Poisson arrivals: throughput",
            out / "open_loop_xrt.png",
        ),
    ):
        if made is not None:
            paths.append(made)
    return paths
