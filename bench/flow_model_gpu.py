"""GPU check and benchmark of the Stage-1 flow model (issue 3), full-size preset, random weights.

    python -m bench flow-model            # from the repo root, one CUDA GPU
    python -m bench flow-model --batches 1,4 --repeats 3   # quicker
    python -m bench flow-model --device cpu --preset small --batches 1,2  # smoke

Sections (each prints as it goes; the JSON is rewritten after each, so a timeout keeps partial
results in $OUT/flow_model_gpu.json):
  1. batch invariance: 16 ragged requests (different voices, prompt/prefix lengths, offsets,
     final and streaming flags, one duplicate) batched vs each alone, in fp32 with TF32 off, fp32
     with TF32 on, bf16; plus bf16 vs fp32 mean relative error; plus CUDA-graph generate vs eager.
  2. chunked == one-shot (invariant 3): upstream's streaming schedule vs one block-causal pass.
  3. ms per solver step (one DiT call on 2B rows) at T=350 for each B, fp32 and bf16, eager and
     CUDA graphs, next to upstream's own estimator on an H200.
  4. ms per full generate() of B requests (10 steps, validation and copies included).
Needs only torch (and numpy through it); torch 2.4+; CUDA events, warm-up, median of repeats.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.args import add_model_args
from flow_service.model import (
    FlowModel,
    FlowRequest,
    GraphedEstimator,
    Voice,
    attention_bias,
    load_flow,
)

TOL = 1e-4  # invariant 1, fp32
# Upstream estimator on an H200, ms per solver step at T=350 (issue 3), by B requests (2B rows).
UPSTREAM_MS = {
    "fp32": {1: 26.8, 4: 44.5, 16: 136.0, 32: 259.0, 64: 492.0},
    "bf16": {1: 25.2, 4: 25.5, 16: 38.0, 32: 68.9, 64: 128.0},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

RESULTS: dict = {}
COMPARE_UPSTREAM = True  # only meaningful for the full preset at T=350 on a GPU


def log(msg: str) -> None:
    print(msg, flush=True)


def save() -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "flow_model_gpu.json").write_text(json.dumps(RESULTS, indent=2))


def set_tf32(on: bool) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return {"matmul.allow_tf32": on, "cudnn.allow_tf32": on}


def make_voice(gen: torch.Generator, num_prompt_tokens: int) -> Voice:
    return Voice(
        prompt_token=torch.randint(0, 6561, (num_prompt_tokens,), generator=gen),
        prompt_feat=torch.randn(2 * num_prompt_tokens, 80, generator=gen) * 2.0 - 6.0,
        embedding=torch.randn(192, generator=gen),
    )


def ragged_requests(seed: int = 0) -> list[FlowRequest]:
    """16 requests: 8 voices (prompt 0..150 tokens), prefixes 9..300 tokens, offsets, final and
    non-final rows, streaming and full attention; the last is a copy of request 3."""
    gen = torch.Generator().manual_seed(seed)
    voices = [make_voice(gen, n) for n in (75, 13, 0, 150, 40, 100, 25, 60)]
    specs = [  # voice, tokens, offset, finalize, streaming
        (0, 28, 0, False, True),
        (0, 78, 25, False, True),
        (1, 60, 20, False, True),
        (2, 30, 0, True, False),
        (3, 110, 60, True, True),
        (4, 9, 0, True, False),
        (5, 300, 0, True, False),
        (6, 178, 75, False, True),
        (7, 45, 40, True, True),
        (1, 57, 4, False, False),
        (3, 53, 0, False, True),
        (4, 200, 150, True, False),
        (5, 103, 0, False, True),
        (6, 250, 175, True, False),
        (7, 3, 0, False, True),
    ]
    reqs = [
        FlowRequest(voices[v], torch.randint(0, 6561, (n,), generator=gen), off, fin, st)
        for v, n, off, fin, st in specs
    ]
    dup = reqs[3]
    v = dup.voice
    copy_voice = Voice(v.prompt_token.clone(), v.prompt_feat.clone(), v.embedding.clone())
    reqs.append(
        FlowRequest(copy_voice, dup.tokens.clone(), dup.token_offset, dup.finalize, dup.streaming)
    )
    return reqs


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def rel_mean(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().mean() / b.abs().mean().clamp(min=1e-12))


def invariance(model: FlowModel, reqs: list[FlowRequest]) -> tuple[dict, list[torch.Tensor]]:
    solos = [model.generate([r])[0] for r in reqs]
    batched = model.generate(reqs)
    errs = [rel_max(b, s) for b, s in zip(batched, solos)]
    out = {
        "rows": len(reqs),
        "max_rel_err": max(errs),
        "per_row_rel_err": errs,
        "identical_rows_bitwise": bool(torch.equal(batched[3], batched[-1])),
        "max_abs_mel": max(float(s.abs().max()) for s in solos if s.numel()),
        "pass_1e-4": max(errs) <= TOL,
    }
    return out, batched


def section_invariance(m32: FlowModel, m16: FlowModel, graphs: bool) -> None:
    reqs = ragged_requests()
    res: dict = {"frames": [r.num_seq_frames for r in reqs]}
    for name, model, tf32 in (("fp32_tf32_off", m32, False), ("fp32_tf32_on", m32, True)):
        res[name] = {"tf32": set_tf32(tf32)}
        stats, outs = invariance(model, reqs)
        res[name].update(stats)
        if name == "fp32_tf32_off":
            ref = outs
        log(
            f"[invariance] {name:14s} max rel err {stats['max_rel_err']:.2e} "
            f"(<= 1e-4: {stats['pass_1e-4']}), duplicate rows bit-identical: "
            f"{stats['identical_rows_bitwise']}"
        )
    set_tf32(False)
    stats, outs16 = invariance(m16, reqs)
    res["bf16"] = stats
    mean_errs = [rel_mean(b, a) for a, b in zip(ref, outs16) if a.numel()]
    res["bf16"]["vs_fp32_mean_rel_err"] = statistics.fmean(mean_errs)
    res["bf16"]["vs_fp32_mean_rel_err_worst_row"] = max(mean_errs)
    log(
        f"[invariance] bf16           max rel err {stats['max_rel_err']:.2e}, bit-identical "
        f"duplicates: {stats['identical_rows_bitwise']}; vs fp32 mean rel err "
        f"{res['bf16']['vs_fp32_mean_rel_err']:.2e} (worst row {max(mean_errs):.2e})"
    )
    for name, model in (("fp32", m32), ("bf16", m16)) if graphs else ():
        graphed = GraphedEstimator(model.decoder.estimator)
        try:
            eager = model.generate(reqs)
            replay = model.generate(reqs, estimator=graphed)
        except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
            res[f"graphs_{name}_error"] = repr(exc)[:300]
            log(f"[invariance] CUDA graphs ({name}) failed: {exc!r}")
            continue
        finally:
            graphed.clear()
        err = max(rel_max(g, e) for g, e in zip(replay, eager))
        res[f"graphs_vs_eager_{name}_max_rel_err"] = err
        log(f"[invariance] CUDA graphs vs eager generate ({name}, TF32 off): max rel err {err:.2e}")
    RESULTS["invariance"] = res
    save()


def section_chunking(m32: FlowModel) -> None:
    set_tf32(False)
    gen = torch.Generator().manual_seed(7)
    voice = make_voice(gen, 75)
    tokens = torch.randint(0, 6561, (250,), generator=gen)
    full = m32.generate([FlowRequest(voice, tokens, 0, finalize=True, streaming=True)])[0]
    chunks, offset = [], 0
    for hop in (25, 50, 100):
        chunks.append(FlowRequest(voice, tokens[: offset + hop + 3], offset, False, True))
        offset += hop
    chunks.append(FlowRequest(voice, tokens, offset, finalize=True, streaming=True))
    solo = torch.cat([m32.generate([c])[0] for c in chunks], dim=1)
    batched = torch.cat(m32.generate(chunks), dim=1)
    res = {
        "tf32": False,
        "chunked_vs_one_shot_max_rel_err": rel_max(solo, full),
        "chunks_batched_vs_one_shot_max_rel_err": rel_max(batched, full),
    }
    RESULTS["chunking"] = res
    log(
        f"[chunking] fp32 chunked vs one-shot: {res['chunked_vs_one_shot_max_rel_err']:.2e} "
        f"(chunks as one batch: {res['chunks_batched_vs_one_shot_max_rel_err']:.2e})"
    )
    save()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_ms(fn, warmup: int, repeats: int) -> float:
    if not torch.cuda.is_available():
        return wall_ms(fn, warmup, repeats)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def estimator_inputs(model: FlowModel, batch: int, frames: int) -> list:
    """One solver step's DiT inputs for `batch` streaming requests of `frames` frames."""
    dev, dtype, rows = model.device, model.dtype, 2 * batch
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, frames, 80, device=dev, generator=gen).to(dtype)
    mu = torch.randn(rows, frames, 80, device=dev, generator=gen).to(dtype)
    cond = torch.randn(rows, frames, 80, device=dev, generator=gen).to(dtype)
    mu[batch:] = 0
    cond[batch:] = 0
    spks = torch.randn(rows, 80, device=dev, generator=gen).to(dtype)
    spks[batch:] = 0
    t = torch.full((rows,), 0.29, device=dev)
    lens = torch.full((rows,), frames, device=dev)
    bias = attention_bias(lens, torch.ones(rows, dtype=torch.bool, device=dev), frames, 50, dtype)
    frame_mask = torch.ones(rows, frames, 1, device=dev, dtype=dtype)
    return [x, mu, cond, spks, t, bias, frame_mask]


def section_step(
    models: dict, batches: list[int], frames: int, repeats: int, graphs: bool, tf32: bool
) -> dict:
    res: dict = {"frames": frames, "tf32": set_tf32(tf32), "ms": {}}
    for name, model in models.items():
        graphed = GraphedEstimator(model.decoder.estimator) if graphs else None
        for b in batches:
            inputs = estimator_inputs(model, b, frames)
            with torch.inference_mode():
                eager = cuda_ms(lambda: model.decoder.estimator(*inputs), 2, repeats)  # noqa: B023
                up = UPSTREAM_MS[name].get(b) if COMPARE_UPSTREAM else None
                row = {"eager": eager, "upstream": up}
                if graphed is not None:
                    try:
                        row["graph"] = cuda_ms(lambda: graphed(*inputs), 2, repeats)  # noqa: B023
                    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
                        row["graph_error"] = repr(exc)[:300]
            res["ms"].setdefault(name, {})[b] = row
            best = min(v for k, v in row.items() if k in ("eager", "graph"))
            up = row["upstream"]
            log(
                f"[step] {name} B={b:3d} rows={2 * b:3d} eager {eager:8.2f} ms"
                + (f"  graph {row['graph']:8.2f} ms" if "graph" in row else "")
                + (f"  upstream {up:7.1f} ms  speed-up x{up / best:.2f}" if up else "")
            )
        if graphed is not None:
            graphed.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    RESULTS["step"] = res
    save()
    return res


def stream_requests(batch: int, seed: int = 1) -> list[FlowRequest]:
    """`batch` streaming chunks of T = 350 frames: prompt 75 tokens + 100 emitted + 3 lookahead."""
    gen = torch.Generator().manual_seed(seed)
    return [
        FlowRequest(
            make_voice(gen, 75), torch.randint(0, 6561, (103,), generator=gen), 0, False, True
        )
        for _ in range(batch)
    ]


def wall_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def section_generate(
    models: dict, batches: list[int], repeats: int, graphs: bool, tf32: bool
) -> dict:
    res: dict = {"frames": 350, "steps": 10, "tf32": set_tf32(tf32), "ms": {}}
    for name, model in models.items():
        graphed = GraphedEstimator(model.decoder.estimator) if graphs else None
        for b in batches:
            reqs = stream_requests(b)
            assert reqs[0].num_seq_frames == 350
            row = {"eager": wall_ms(lambda: model.generate(reqs), 1, repeats)}  # noqa: B023
            if graphed is not None:
                try:
                    row["graph"] = wall_ms(
                        lambda: model.generate(reqs, estimator=graphed),  # noqa: B023
                        1,
                        repeats,
                    )
                except Exception as exc:  # noqa: BLE001
                    row["graph_error"] = repr(exc)[:300]
            res["ms"].setdefault(name, {})[b] = row
            log(
                f"[generate] {name} B={b:3d} eager {row['eager']:8.1f} ms"
                + (f"  graph {row['graph']:8.1f} ms" if "graph" in row else "")
                + f"  ({b * 4} s of new mel per call)"
            )
        if graphed is not None:
            graphed.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    RESULTS["generate"] = res
    save()
    return res


def print_table(step: dict, gen: dict | None) -> None:
    tf32 = "on" if step["tf32"]["matmul.allow_tf32"] else "off"
    log(f"\n== ms per solver step (one DiT call on 2B rows), T = {step['frames']}, TF32 {tf32} ==")
    log(f"{'dtype':5s} {'B':>4s} {'eager':>9s} {'graph':>9s} {'upstream':>9s} {'x faster':>9s}")
    for name, rows in step["ms"].items():
        for b, row in rows.items():
            best = min(v for k, v in row.items() if k in ("eager", "graph"))
            up = row.get("upstream")
            graph = f"{row['graph']:9.2f}" if "graph" in row else f"{'-':>9s}"
            ratio = f"{up / best:9.2f}" if up else f"{'-':>9s}"
            upstr = f"{up:9.1f}" if up else f"{'-':>9s}"
            log(f"{name:5s} {b:4d} {row['eager']:9.2f} {graph} {upstr} {ratio}")
    if gen:
        log(f"\n== ms per generate() (10 steps, B requests of T = 350), TF32 {tf32} ==")
        log(f"{'dtype':5s} {'B':>4s} {'eager':>9s} {'graph':>9s}")
        for name, rows in gen["ms"].items():
            for b, row in rows.items():
                graph = f"{row['graph']:9.1f}" if "graph" in row else f"{'-':>9s}"
                log(f"{name:5s} {b:4d} {row['eager']:9.1f} {graph}")
    inv = RESULTS.get("invariance")
    if inv:
        log("\n== batch invariance, 16 ragged rows vs alone (max abs err / max|mel|) ==")
        for name in ("fp32_tf32_off", "fp32_tf32_on", "bf16"):
            r = inv[name]
            log(
                f"{name:14s} {r['max_rel_err']:.2e}  duplicates bit-identical: "
                f"{r['identical_rows_bitwise']}"
            )
        log(f"bf16 vs fp32 mean relative error: {inv['bf16']['vs_fp32_mean_rel_err']:.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, dtype=None)  # times both dtypes
    parser.add_argument("--batches", default="1,4,16,32,64")
    parser.add_argument("--frames", type=int, default=350)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--generate-repeats", type=int, default=3)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--skip", default="", help="comma list of: invariance,chunking,generate")
    parser.add_argument("--tf32", action="store_true", help="time fp32 with TF32 on (default off)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        log("needs a CUDA device (or --device cpu --preset small for a smoke run)")
        return 2
    graphs = args.device == "cuda" and not args.no_graphs
    global COMPARE_UPSTREAM
    COMPARE_UPSTREAM = (args.device, args.preset, args.frames) == ("cuda", "cosyvoice3-0.5b", 350)
    batches = [int(b) for b in args.batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    t_start = time.perf_counter()
    RESULTS["env"] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "preset": args.preset,
        "weights": "random, seed 0",
    }
    log(f"{RESULTS['env']}")

    torch.set_grad_enabled(False)
    cpu_model = load_flow(None, preset=args.preset, seed=0)
    m32 = cpu_model.to(args.device)
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    RESULTS["env"]["params"] = sum(p.numel() for p in m32.parameters())
    log(
        f"built {args.preset}: {RESULTS['env']['params']:,} parameters ({time.perf_counter() - t_start:.0f} s)"
    )

    if "invariance" not in skip:
        section_invariance(m32, m16, graphs)
    if "chunking" not in skip:
        section_chunking(m32)
    models = {"fp32": m32, "bf16": m16}
    step = section_step(models, batches, args.frames, args.repeats, graphs, args.tf32)
    gen = None
    if "generate" not in skip:
        gen = section_generate(models, batches, args.generate_repeats, graphs, args.tf32)
    print_table(step, gen)
    RESULTS["env"]["total_s"] = time.perf_counter() - t_start
    save()
    log(
        f"\ntotal {RESULTS['env']['total_s']:.0f} s; tf32 was set explicitly per section (see JSON)"
    )
    return 0
