r"""DiT kernel variants (issue 17 item 2): time, throughput, MFU and exactness of a full solve.

    python -m bench kernels --device cuda --graphs --budget-s 500 \
        --out $OUT/kernels.json        # one H200: bf16 first, then what fits of fp32
    python -m bench kernels --device cpu --preset small --rows 2 \
        --frames 206 --repeats 1 --budget-s 60   # CPU smoke (nothing compiles on the CPU)

Variants (`DiTKernels`, the flow service fuses norms on CUDA): baseline (SDPA with the dense additive
bias, unfused norms) and fused (compiled gate + residual + LN + modulate). Each case is B requests of T frames
(3 s prompt of 75 tokens + the rest emitted tokens), all streaming (non-final, block-causal) or
all final (full attention), run as one `FlowModel.generate` (10 Euler steps, CFG: 2B solver rows;
eager, mel left on the device; with --graphs, every variant also as CUDA-graph replays, as the
service runs batches of up to 64 requests). Per case and variant it prints:

- ms: median wall time of a full solve over --repeats runs, after one warm-up run whose time is
  reported apart (`first_ms`: compile + allocator + autotuning on a variant's first use);
- frame-steps/s: B x T x 10 / median s (the service's throughput unit);
- TFLOP/s and MFU: an analytic count of the useful multiply-adds x 2 per solve, over the median
  time. Per solver row and step: the input projection (4c -> d per frame), the two grouped
  convs of the position embedding, per layer the q/k/v/out projections (4 d^2 per frame) and
  the FFN (2 d f per frame), attention QK^T and PV (2 d per visible (query, key) pair: T^2 for
  a full row, sum over queries of min(T, its block end) for a streaming row: the keys the mask
  lets it read, not the dense T^2 the bias path computes), the final projection (d c per frame),
  and the per-row AdaLN/time-MLP projections. MFU is against 790 TFLOP/s dense bf16 (the
  H200 figure the project uses); fp32 against 395 (TF32 tensor cores, half of bf16) with --tf32,
  else 67 (fp32 SIMT);
- exactness: max |mel - baseline mel| / max |baseline mel| of the same requests.

It stops starting work at --budget-s (a run already started finishes): cases run in order of
importance (bf16 before fp32, large before small), and a variant whose estimated cost (from the
throughput measured so far, plus a compile allowance on first use) does not fit the time left is
skipped and listed. The JSON (--out) is rewritten after every case.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.args import add_model_args
from bench.flow_model_gpu import make_voice
from flow_service.model import (
    DiTKernels,
    FlowModel,
    FlowRequest,
    GraphedEstimator,
    load_flow,
)

VARIANTS = {
    "baseline": DiTKernels(),
    "fused": DiTKernels(fused_norms=True),
}
# With --graphs, batches of up to GRAPH_MAX_ROWS requests (the flow service's default
# --graph-max-batch) also run as the service runs them: CUDA-graph replays.
GRAPH_VARIANTS = {f"{name}+graphs": kernels for name, kernels in VARIANTS.items()}
GRAPH_MAX_ROWS = 64
PEAK_TFLOPS = {"bf16": 790.0, "tf32": 395.0, "fp32": 67.0}
PROMPT_TOKENS = 75  # 3 s
COMPILE_RESERVE_S = 90.0  # what a variant's first use (compile) may cost, for the budget check


def make_requests(rows: int, frames: int, streaming: bool, seed: int = 0) -> list[FlowRequest]:
    """`rows` requests of DiT length `frames`: a 3 s prompt and frames/2 - 75 emitted tokens;
    streaming rows are non-final calls (3 real lookahead tokens, block-causal attention),
    the others final calls (full attention)."""
    gen = torch.Generator().manual_seed(seed)
    n_p = min(PROMPT_TOKENS, frames // 4)
    n_emit = frames // 2 - n_p
    reqs = []
    for _ in range(rows):
        voice = make_voice(gen, n_p)
        tokens = torch.randint(0, 6561, (n_emit + (3 if streaming else 0),), generator=gen)
        reqs.append(FlowRequest(voice, tokens, 0, not streaming, streaming))
    assert all(r.num_seq_frames == frames for r in reqs), (frames, reqs[0].num_seq_frames)
    return reqs


def visible_pairs(frames: int, streaming: bool, block: int) -> int:
    """(query, key) pairs the mask lets one row read."""
    if not streaming:
        return frames * frames
    return sum(min(frames, (i // block + 1) * block) for i in range(frames))


def solve_flops(model: FlowModel, rows: int, frames: int, streaming: bool) -> float:
    """Useful FLOPs (2 per multiply-add) of one generate: 10 steps x 2 rows (CFG) per request."""
    cfg = model.cfg.dit
    d, f, c = cfg.dim, cfg.dim * cfg.ff_mult, cfg.mel_dim
    in_width = 2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim
    per_frame = in_width * d + 2 * cfg.conv_pos_kernel * d * (d // cfg.conv_pos_groups)
    per_frame += cfg.depth * (4 * d * d + 2 * d * f) + d * c
    per_row = cfg.time_freq_dim * d + d * d + cfg.depth * 6 * d * d + 2 * d * d
    attention = cfg.depth * 2 * d * visible_pairs(frames, streaming, cfg.block_frames)
    macs = frames * per_frame + per_row + attention
    return 2.0 * macs * 2 * rows * len(model.decoder.steps)


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.start = time.perf_counter()
        self.device = torch.device(args.device)
        self.results: dict = {
            "device": torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda"
            else "cpu",
            "torch": torch.__version__,
            "preset": args.preset,
            "tf32": args.tf32,
            "repeats": args.repeats,
            "budget_s": args.budget_s,
            "peak_tflops": PEAK_TFLOPS,
            "variants": {k: asdict(v) for k, v in {**VARIANTS, **GRAPH_VARIANTS}.items()},
            "cases": [],
            "skipped": [],
            "errors": [],
        }
        self.frame_steps_per_s: dict[str, float] = {}  # dtype -> slowest rate seen (estimates)
        self.used: set[tuple[str, str]] = set()  # (dtype, variant) already compiled

    def left_s(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.start)

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        if self.args.out:
            Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.args.out).write_text(json.dumps(self.results, indent=2))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, model: FlowModel, reqs: list[FlowRequest], estimator=None):
        self.sync()
        t0 = time.perf_counter()
        out = model.generate(reqs, to_cpu=False, estimator=estimator)
        self.sync()
        return 1e3 * (time.perf_counter() - t0), torch.stack(out)

    def estimate_s(self, dtype: str, variant: str, rows: int, frames: int) -> float:
        rate = self.frame_steps_per_s.get(dtype)
        per_run = rows * frames * 10 / rate if rate else 5.0
        compiles = self.device.type == "cuda" and not variant.startswith("baseline")
        reserve = self.args.compile_reserve_s
        first = reserve if compiles and (dtype, variant) not in self.used else 0.0
        return (1 + self.args.repeats) * per_run + first

    def run_case(self, model, dtype: str, rows: int, frames: int, streaming: bool) -> None:
        kind = "streaming" if streaming else "final"
        name = f"{dtype} {rows}x{frames} {kind}"
        reqs = make_requests(rows, frames, streaming)
        flops = solve_flops(model, rows, frames, streaming)
        peak = PEAK_TFLOPS["bf16" if dtype == "bf16" else ("tf32" if self.args.tf32 else "fp32")]
        dit = model.decoder.estimator
        case = {"dtype": dtype, "rows": rows, "frames": frames, "kind": kind, "variants": {}}
        base = None
        variants = dict(VARIANTS)
        if self.args.graphs and self.device.type == "cuda" and rows <= GRAPH_MAX_ROWS:
            variants.update(GRAPH_VARIANTS)
        # baseline always runs first: it is the reference of every diff
        wanted = {"baseline", *self.args.variants}
        variants = {k: v for k, v in variants.items() if k.removesuffix("+graphs") in wanted}
        for variant, kernels in variants.items():
            need = self.estimate_s(dtype, variant, rows, frames)
            if need > self.left_s():
                self.results["skipped"].append(f"{name} {variant}: ~{need:.0f} s > budget left")
                print(f"[skip] {name} {variant}: needs ~{need:.0f} s, {self.left_s():.0f} s left")
                continue
            dit.kernels = kernels
            graphed = GraphedEstimator(dit) if variant in GRAPH_VARIANTS else None
            try:
                with torch.inference_mode():
                    first_ms, mel = self.timed(model, reqs, graphed)  # + capture when graphed
                    times = [self.timed(model, reqs, graphed)[0] for _ in range(self.args.repeats)]
            except Exception as exc:  # noqa: BLE001 - report and go on with the other variants
                msg = f"{name} {variant}: {exc!r}"[:500]
                self.results["errors"].append(msg)
                print(f"[error] {msg}", flush=True)
                continue
            finally:
                dit.kernels = VARIANTS["baseline"]
                if graphed is not None:
                    graphed.clear()
            self.used.add((dtype, variant))
            ms = statistics.median(times)
            rate = rows * frames * 10 / (ms / 1e3)
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
            print(
                f"{name:28s} {variant:11s} {ms:9.1f} ms  {rate / 1e3:8.1f}k frame-steps/s  "
                f"{tflops:7.1f} TFLOP/s  MFU {100 * tflops / peak:5.1f} %  "
                f"first {first_ms / 1e3:6.1f} s  "
                + (f"diff {diff:.2e}" if diff is not None else "diff n/a (no baseline)"),
                flush=True,
            )
        case["gflop_per_solve"] = round(flops / 1e9, 1)
        if case["variants"]:
            self.results["cases"].append(case)
        self.save()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, dtype=None)  # --dtypes picks several
    p.add_argument("--dtypes", default="bf16,fp32", help="comma list of bf16, fp32, in order")
    p.add_argument("--rows", default="64,32,8,1", help="requests per batch, in order of priority")
    p.add_argument("--frames", default="656,506,206", help="DiT lengths T, in order of priority")
    p.add_argument("--kinds", default="final,streaming", help="final and/or streaming")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
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
    p.add_argument("--out", default="", help="JSON results path (rewritten after each case)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    bench = Bench(args)
    rows_list = [int(x) for x in args.rows.split(",")]
    frames_list = [int(x) for x in args.frames.split(",")]
    kinds = args.kinds.split(",")
    for dtype in args.dtypes.split(","):
        if bench.left_s() < 30:
            bench.results["skipped"].append(f"{dtype}: every case, no budget left to load it")
            print(f"[skip] {dtype}: {bench.left_s():.0f} s left")
            continue
        model = load_flow(None, device=args.device, dtype=dtypes[dtype], preset=args.preset)
        for rows in rows_list:
            for frames in frames_list:
                for kind in kinds:
                    bench.run_case(model, dtype, rows, frames, kind == "streaming")
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    bench.save()
    res = bench.results
    print(
        f"done in {res['elapsed_s']} s: {len(res['cases'])} cases, "
        f"{len(res['skipped'])} variant runs skipped for the budget, {len(res['errors'])} errors"
    )
