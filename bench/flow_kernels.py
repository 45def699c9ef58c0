r"""DiT kernel variants of the flow model, random weights: time, throughput, MFU, exactness.

    python -m bench kernels --graphs --budget-s 500   # one H200: bf16 first, then what fits
    python -m bench kernels --smoke                   # CPU, small preset, seconds

kernels (`DiTKernels`; the flow service runs fused+rotary+conv on CUDA; writes
OUT/kernels_bench.json after each case): baseline (SDPA with the dense additive bias, unfused
norms), fused (compiled gate + residual + LN + modulate), fused+rotary (also the rotary on q and
k as one compiled kernel) and fused+rotary+conv (also each position conv stage as one Triton
kernel). Each case is B requests of T frames (3 s prompt + the rest emitted tokens), all
streaming (non-final, block-causal) or all final (full attention), run as one
`FlowModel.generate` (10 Euler steps, CFG: 2B solver rows; mel left on the device; with --graphs,
every variant also as CUDA-graph replays for batches the service graphs). Per case:
- ms: median of --repeats full solves after --warmup untimed ones; the first one's time is `first_ms`
  (compile + allocator + autotuning on a variant's first use);
- frame-steps/s: B x T x 10 / median s (the service's throughput unit);
- TFLOP/s and MFU: an analytic count of the useful multiply-adds x 2 per solve (`solve_flops`:
  attention counts only the (query, key) pairs the mask lets a row read), over the median
  time, against 790 TFLOP/s dense bf16 (H200); fp32 against 395 (TF32) with --tf32, else 67;
- exactness: max |mel - baseline mel| / max |baseline mel| of the same requests.
It stops starting work at --budget-s: cases run in order of importance (bf16 before fp32,
large before small), and a variant whose estimated cost does not fit the time left is skipped
and listed.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import asdict

import torch

from bench import parts
from bench.flow_model import log, make_requests, timed_solve
from flow_service.config import FlowConfig as FlowServiceConfig
from flow_service.model import (
    FUSED_KERNELS,
    NUM_STEPS,
    DiTKernels,
    FlowModel,
    GraphedEstimator,
    load_flow,
)

VARIANTS = {
    "baseline": DiTKernels(),
    "fused": DiTKernels(fused_norms=True),
    "fused+rotary": DiTKernels(fused_norms=True, fused_rotary=True),
    "fused+rotary+conv": FUSED_KERNELS,
}
GRAPH_VARIANTS = {f"{name}+graphs": kernels for name, kernels in VARIANTS.items()}
GRAPH_MAX_ROWS = FlowServiceConfig().graph_max_batch  # batches the service replays as graphs
PEAK_TFLOPS = {"bf16": 790.0, "tf32": 395.0, "fp32": 67.0}
COMPILE_RESERVE_S = 90.0  # what a variant's first use (compile) may cost, for the budget check


def visible_pairs(frames: int, streaming: bool, block: int) -> int:
    """(query, key) pairs the mask lets one row read."""
    if not streaming:
        return frames * frames
    return sum(min(frames, (i // block + 1) * block) for i in range(frames))


def solve_flops(model: FlowModel, rows: int, frames: int, streaming: bool) -> float:
    """Useful FLOPs (2 per multiply-add) of one generate: 10 steps x 2 rows (CFG) per request.
    Per solver row and step: the input projection (4c -> d per frame), the position
    embedding's two grouped convs, per layer q/k/v/out (4 d^2 per frame) and the FFN (2 d f),
    attention QK^T and PV (2 d per visible pair), the final projection (d c per frame), and
    the per-row AdaLN/time-MLP projections."""
    cfg = model.cfg.dit
    d, f, c = cfg.dim, cfg.dim * cfg.ff_mult, cfg.mel_dim
    in_width = 2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim
    per_frame = in_width * d + 2 * cfg.conv_pos_kernel * d * (d // cfg.conv_pos_groups)
    per_frame += cfg.depth * (4 * d * d + 2 * d * f) + d * c
    per_row = cfg.time_freq_dim * d + d * d + cfg.depth * 6 * d * d + 2 * d * d
    attention = cfg.depth * 2 * d * visible_pairs(frames, streaming, cfg.block_frames)
    macs = frames * per_frame + per_row + attention
    return 2.0 * macs * 2 * rows * len(model.decoder.steps)


class KernelBench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.start = time.perf_counter()
        self.cuda = torch.device(a.device).type == "cuda"
        self.results: dict = {
            "device": torch.cuda.get_device_name(a.device) if self.cuda else "cpu",
            "torch": torch.__version__,
            "preset": a.preset,
            "tf32": a.tf32,
            "repeats": a.repeats,
            "budget_s": a.budget_s,
            "peak_tflops": PEAK_TFLOPS,
            "variants": {k: asdict(v) for k, v in {**VARIANTS, **GRAPH_VARIANTS}.items()},
            "cases": [],
            "skipped": [],
            "errors": [],
        }
        self.frame_steps_per_s: dict[str, float] = {}  # dtype -> slowest rate seen (estimates)
        self.used: set[tuple[str, str]] = set()  # (dtype, variant) already compiled

    def left_s(self) -> float:
        return self.a.budget_s - (time.perf_counter() - self.start)

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        parts.save(self.a, self.results, "kernels_bench")

    def estimate_s(self, dtype: str, variant: str, rows: int, frames: int) -> float:
        rate = self.frame_steps_per_s.get(dtype)
        per_run = rows * frames * NUM_STEPS / rate if rate else 5.0
        compiles = self.cuda and not variant.startswith("baseline")
        first = self.a.compile_reserve_s if compiles and (dtype, variant) not in self.used else 0
        return (1 + self.a.repeats) * per_run + first

    def run_case(self, model, dtype: str, rows: int, frames: int, streaming: bool) -> None:
        kind = "streaming" if streaming else "final"
        name = f"{dtype} {rows}x{frames} {kind}"
        reqs = make_requests(rows, frames, streaming)
        flops = solve_flops(model, rows, frames, streaming)
        peak = PEAK_TFLOPS["bf16" if dtype == "bf16" else ("tf32" if self.a.tf32 else "fp32")]
        dit = model.decoder.estimator
        case = {"dtype": dtype, "rows": rows, "frames": frames, "kind": kind, "variants": {}}
        base = None
        variants = dict(VARIANTS)
        if self.a.graphs and self.cuda and rows <= GRAPH_MAX_ROWS:
            variants.update(GRAPH_VARIANTS)
        wanted = {"baseline", *self.a.variants}  # baseline first: the reference of every diff
        variants = {k: v for k, v in variants.items() if k.removesuffix("+graphs") in wanted}
        for variant, kernels in variants.items():
            need = self.estimate_s(dtype, variant, rows, frames)
            if need > self.left_s():
                self.results["skipped"].append(f"{name} {variant}: ~{need:.0f} s > budget left")
                log(f"[skip] {name} {variant}: needs ~{need:.0f} s, {self.left_s():.0f} s left")
                continue
            dit.kernels = kernels
            graphed = GraphedEstimator(dit) if variant in GRAPH_VARIANTS else None
            try:
                timing = timed_solve(
                    model, reqs, self.a, estimator=graphed, to_cpu=False, warmup=self.a.warmup
                )
            except Exception as exc:  # noqa: BLE001 - report and go on with the other variants
                msg = f"{name} {variant}: {exc!r}"[:500]
                self.results["errors"].append(msg)
                log(f"[error] {msg}")
                continue
            finally:
                dit.kernels = VARIANTS["baseline"]
                if graphed is not None:
                    graphed.clear()
            self.used.add((dtype, variant))
            ms, first_ms, mel = timing.median, timing.first_ms, torch.stack(timing.out)
            rate = rows * frames * NUM_STEPS / (ms / 1e3)
            slowest = self.frame_steps_per_s.get(dtype)
            self.frame_steps_per_s[dtype] = min(rate, slowest) if slowest else rate
            tflops = flops / (ms / 1e3) / 1e12
            row = {
                "ms": round(ms, 2),
                "first_ms": round(first_ms, 1),
                "warmup_ms": round(first_ms - ms, 1),
                "frame_steps_per_s": round(rate),
                "tflops": round(tflops, 4),
                "mfu": round(tflops / peak, 6),
            }
            if base is None and variant == "baseline":
                base = mel.float()
            if base is not None:
                diff = (mel.float() - base).abs().max() / base.abs().max().clamp(min=1e-12)
                row["rel_max_diff_vs_baseline"] = float(diff)
            case["variants"][variant] = row
            diff = row.get("rel_max_diff_vs_baseline")
            log(
                f"{name:28s} {variant:11s} {ms:9.1f} ms  {rate / 1e3:8.1f}k frame-steps/s  "
                f"{tflops:7.1f} TFLOP/s  MFU {100 * tflops / peak:5.1f} %  "
                f"first {first_ms / 1e3:6.1f} s  "
                + (f"diff {diff:.2e}" if diff is not None else "diff n/a (no baseline)")
            )
        case["gflop_per_solve"] = round(flops / 1e9, 1)
        if case["variants"]:
            self.results["cases"].append(case)
        self.save()


def main(argv: list[str] | None = None) -> int:
    p = parts.parser(
        "kernels",
        __doc__,
        dtype="bfloat16,float32",
        repeats=3,
        warmup=1,
        smoke={
            "dtype": ["float32"],
            "rows": [1],
            "frames": [206],
            "kinds": ["streaming"],
            "warmup": 1,
        },
    )
    p.add_argument("--rows", type=parts.ints, default=[64, 32, 8, 1], help="requests per batch")
    p.add_argument("--frames", type=parts.ints, default=[656, 506, 206], help="DiT lengths T")
    p.add_argument(
        "--kinds",
        type=lambda t: [k for k in t.split(",") if k],
        default=["final", "streaming"],
        help="final and/or streaming",
    )
    p.add_argument("--tf32", action="store_true", help="allow TF32 in fp32 matmuls/convs")
    p.add_argument(
        "--graphs",
        action="store_true",
        help=f"CUDA: also time every variant as CUDA-graph replays for <= {GRAPH_MAX_ROWS} "
        "requests (as the service runs them)",
    )
    p.add_argument(
        "--variants",
        type=lambda text: [v for v in text.split(",") if v],
        default=list(VARIANTS),
        help=f"kernel variants to time, of {', '.join(VARIANTS)} (baseline always runs)",
    )
    p.add_argument(
        "--compile-reserve-s",
        type=float,
        default=COMPILE_RESERVE_S,
        help="budget set aside for a compiled variant's first use (its compile)",
    )
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting work after this")
    a = parts.parse(p, argv)
    unknown = sorted(set(a.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    bad = sorted(set(a.kinds) - {"final", "streaming"})
    if bad:
        p.error(f"--kinds: unknown {', '.join(bad)}; choose from final, streaming")
    if a.warmup < 1:
        p.error("--warmup: want >= 1 (the first solve's time is reported apart, as first_ms)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if torch.device(a.device).type == "cuda":
        parts.set_tf32(a.tf32)
    bench = KernelBench(a)
    for dtype in a.dtype:
        short = parts.SHORT[dtype]
        if bench.left_s() < 30:
            bench.results["skipped"].append(f"{short}: every case, no budget left to load it")
            log(f"[skip] {short}: {bench.left_s():.0f} s left")
            continue
        model = load_flow(
            a.model_dir, device=a.device, dtype=parts.DTYPES[dtype], preset=a.preset, seed=a.seed
        )
        for rows in a.rows:
            for frames in a.frames:
                for kind in a.kinds:
                    bench.run_case(model, short, rows, frames, kind == "streaming")
        del model
        if bench.cuda:
            torch.cuda.empty_cache()
    bench.save()
    res = bench.results
    log(
        f"done in {res['elapsed_s']} s: {len(res['cases'])} cases, "
        f"{len(res['skipped'])} variant runs skipped for the budget, {len(res['errors'])} errors"
    )
    return 0
