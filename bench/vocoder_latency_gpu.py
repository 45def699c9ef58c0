"""Vocoder batch latency with CUDA graphs off and on (issue 17, item 3).

Run from the repo root on a CUDA machine (torch + numpy only; ~1 min on an H200):

    python -m bench vocoder-latency

Full-size HiFT preset (cosyvoice3-0.5b, seeded random weights), timed as the service's runner
runs a vocoder batch (`decode_batch` in inference mode on its own CUDA stream: host prep, f0
predictor, decoder, audio back on the host), for the four shapes that set single-stream and loaded latency:

    first x1     1 session,   its first chunk (50 mel frames, upstream's schedule)
    100f x1      1 session,   a 100-frame chunk after the first
    first x24    24 sessions, each a first chunk (a burst of new streams)
    100f x24     24 sessions, each a 100-frame chunk

For each, in float32 (torch's default TF32 settings, as the service runs) and bfloat16: median
and p90 ms per batch with `--cuda-graphs` off (eager, unpadded) and on (Snake in 4 kernels,
rows and frames padded to the service's default buckets, graph replay; the capture happens
before timing, as the service's warm-up does), the max abs difference of the audio between off and on, and, for the
eager path, the number of GPU kernels per batch and their summed GPU time from one profiled
batch: kernel time far below the wall time means the batch is launch-bound.

Prints a table; writes the figures to $OUT/vocoder_latency_gpu.json when $OUT is set.
`--smoke` runs the same code on the CPU with the small preset, batch 3 instead of 24 and one
repeat, with padding but no graphs (a logic check; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch

from bench.gpu import save_json
from vocoder_service.model import MEL_BINS, HiFTSessionState, load_hift
from vocoder_service.model.graphs import GraphedCore, ShapeBuckets

FIRST, LATER = 50, 100  # frames: upstream's first chunk, then 100 (later 200)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, small preset, no graphs: a logic check, not a measurement",
    )
    return p


def _configure(smoke: bool) -> None:
    """The run's sizes, module-wide: the full run's at import, --smoke's when main asks."""
    global SMOKE, PRESET, DEVICE, MANY, REPEATS, WARMUP, CASES
    SMOKE = smoke
    PRESET = "small" if smoke else "cosyvoice3-0.5b"
    DEVICE = "cpu" if smoke else "cuda"
    MANY = 3 if smoke else 24
    REPEATS = 1 if smoke else 20
    WARMUP = 0 if smoke else 3
    CASES = (  # name, sessions, frames each session has already taken, chunk frames
        ("first x1", 1, 0, FIRST),
        ("100f x1", 1, FIRST, LATER),
        (f"first x{MANY}", MANY, 0, FIRST),
        (f"100f x{MANY}", MANY, FIRST, LATER),
    )


_configure(False)


def make_mel(frames: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(MEL_BINS, frames, generator=g) - 5).numpy()


class Runner:
    """What `vocoder_service.runner.HiFTRunner.execute` does around the model, without its
    gRPC-side imports (this script needs torch and numpy only): inference mode, a dedicated
    CUDA stream, synchronised, audio back as numpy."""

    def __init__(self, model):
        self.model = model
        self.stream = torch.cuda.Stream() if not SMOKE else None

    def new_state(self):
        return self.model.new_session()

    def execute(self, states, mels, finalize) -> list[np.ndarray]:
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with torch.inference_mode(), ctx:
            out = self.model.decode_batch(states, [torch.from_numpy(m) for m in mels], finalize)
            if self.stream is not None:
                self.stream.synchronize()
        return [a.to("cpu", torch.float32).numpy() for a in out]


class Modes:
    """One model, switched between the flag off (eager, no padding) and on (fused Snake,
    buckets, graphs; on the CPU no graphs)."""

    def __init__(self, model):
        self.model = model
        self.buckets = ShapeBuckets.for_limits()  # the service's default buckets
        self.graphed = None
        if not SMOKE:
            look = model.cfg.conv_pre_look_right
            self.graphed = GraphedCore(model.synthesize_core, model.device, self.buckets, look)

    def set(self, on: bool) -> None:
        self.model.fuse_snake(on)  # as the service's load_model does with the flag on
        self.model.buckets = self.buckets if on else ShapeBuckets()
        self.model.graphed_core = self.graphed if on else None


def case_inputs(runner: Runner, rows: int, history: int, chunk: int):
    """Session blobs after `history` frames, and the chunk each session gets next."""
    mels = [make_mel(history + chunk, seed=100 + i) for i in range(rows)]
    states = [runner.new_state() for _ in range(rows)]
    if history:
        runner.execute(states, [m[:, :history] for m in mels], [False] * rows)
    return [st.to_bytes() for st in states], [np.ascontiguousarray(m[:, history:]) for m in mels]


def run_once(runner, blobs, chunks):
    states = [HiFTSessionState.from_bytes(b) for b in blobs]
    t0 = time.perf_counter()
    audio = runner.execute(states, chunks, [False] * len(chunks))  # synchronises its stream
    return (time.perf_counter() - t0) * 1e3, audio


def timed(runner, blobs, chunks):
    times, audio = [], None
    for i in range(WARMUP + REPEATS):
        ms, audio = run_once(runner, blobs, chunks)
        if i >= WARMUP:
            times.append(ms)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))], audio


def kernel_profile(runner, blobs, chunks) -> tuple[int, float]:
    """(GPU kernels, their summed ms) of one batch; (0, 0) on the CPU."""
    if SMOKE:
        return 0, 0.0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_once(runner, blobs, chunks)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), sum(e.time_range.elapsed_us() for e in kernels) / 1e3


def measure(dtype_name: str, dtype: torch.dtype, res: dict) -> None:
    model = load_hift(None, device=DEVICE, dtype=dtype, preset=PRESET)
    runner = Runner(model)
    modes = Modes(model)
    for name, rows, history, chunk in CASES:
        modes.set(False)
        blobs, chunks = case_inputs(runner, rows, history, chunk)
        off_p50, off_p90, off_audio = timed(runner, blobs, chunks)
        n_kernels, kernel_ms = kernel_profile(runner, blobs, chunks)
        modes.set(True)
        run_once(runner, blobs, chunks)  # captures this shape's graph (the service's warm-up)
        on_p50, on_p90, on_audio = timed(runner, blobs, chunks)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(on_audio, off_audio) if a.size)
        res[f"{dtype_name} {name}"] = {
            "off_p50_ms": off_p50,
            "off_p90_ms": off_p90,
            "on_p50_ms": on_p50,
            "on_p90_ms": on_p90,
            "max_abs_diff": diff,
            "eager_kernels": n_kernels,
            "eager_kernel_ms": kernel_ms,
        }
    if modes.graphed is not None:
        res[f"{dtype_name} graphs"] = len(modes.graphed)


def main(argv: list[str] | None = None) -> int:
    _configure(_parser().parse_args(argv).smoke)
    if not SMOKE and not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke for a CPU logic check)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    res: dict = {
        "device": torch.cuda.get_device_name() if not SMOKE else "cpu (smoke: no graphs)",
        "torch": torch.__version__,
        "preset": PRESET,
        "tf32_conv": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        measure(name, dtype, res)
    if not SMOKE:
        res["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["total_s"] = time.perf_counter() - start
    report(res)
    save_json("vocoder_latency_gpu.json", res)
    return 0


def report(r: dict) -> None:
    print(f"\nHiFT {r['preset']} on {r['device']}, torch {r['torch']}")
    print(f"cuDNN TF32 {r['tf32_conv']}, cudnn.benchmark {r['cudnn_benchmark']}")
    print("ms per vocoder batch (as HiFTRunner.execute), --cuda-graphs off vs on")
    head = "  {:<16} {:>9} {:>9} {:>9} {:>9} {:>7} {:>10} {:>8} {:>9}"
    print(head.format("case", "off p50", "off p90", "on p50", "on p90", "speedup", "max diff",
                      "kernels", "kernel ms"))  # fmt: skip
    for dtype in ("fp32", "bf16"):
        for name, *_ in CASES:
            c = r[f"{dtype} {name}"]
            print(
                f"  {dtype + ' ' + name:<16} {c['off_p50_ms']:9.2f} {c['off_p90_ms']:9.2f} "
                f"{c['on_p50_ms']:9.2f} {c['on_p90_ms']:9.2f} "
                f"{c['off_p50_ms'] / c['on_p50_ms']:6.2f}x {c['max_abs_diff']:10.2e} "
                f"{c['eager_kernels']:8d} {c['eager_kernel_ms']:9.2f}"
            )
    print("  (kernels, kernel ms: GPU kernels of one eager batch and their summed GPU time)")
    if "fp32 graphs" in r:
        print(f"graphs held: fp32 {r['fp32 graphs']}, bf16 {r['bf16 graphs']}")
        print(f"peak GPU memory {r['peak_gpu_mem_gib']:.2f} GiB")
    print(f"total {r['total_s']:.0f} s")
