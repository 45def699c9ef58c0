r"""The Stage-1 flow model alone, random weights: exactness and timing, and the inputs the
flow parts share (bench/flow_kernels.py, bench/flow_profile.py).

    python -m bench flow-model                        # one CUDA GPU, full size
    python -m bench flow-model --batches 1,4 --repeats 3
    python -m bench flow-model --smoke                # CPU, small preset, seconds

flow-model (writes OUT/flow_model_gpu.json after each section, so a timeout keeps the rest):
  1. batch invariance: 16 ragged requests (different voices, prompt/prefix lengths, offsets,
     final and streaming flags, one duplicate) batched vs each alone, in fp32 with TF32 off, fp32
     with TF32 on, bf16; plus bf16 vs fp32 mean relative error; plus CUDA-graph generate vs eager.
  2. chunked == one-shot (invariant 3): upstream's streaming schedule vs one block-causal pass.
  3. ms per solver step (one DiT call on 2B rows, its inputs as the solver builds them) at
     T = --frames for each B, fp32 and bf16, eager and CUDA graphs (GPU time between CUDA
     events), next to upstream's own estimator on an H200.
  4. ms per full generate() of B requests (10 steps, validation and copies included).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from bench import parts
from flow_service.model import (
    MEL_BINS,
    NUM_STEPS,
    SPK_EMBED_DIM,
    VOCAB_SIZE,
    FlowModel,
    FlowRequest,
    GraphedEstimator,
    Voice,
    load_flow,
)

TOL = 1e-4  # invariant 1, fp32
# Upstream estimator on an H200, ms per solver step at T=350 (issue 3), by B requests (2B rows).
UPSTREAM_MS = {
    "fp32": {1: 26.8, 4: 44.5, 16: 136.0, 32: 259.0, 64: 492.0},
    "bf16": {1: 25.2, 4: 25.5, 16: 38.0, 32: 68.9, 64: 128.0},
}
PROMPT_TOKENS = 75  # 3 s


def log(msg: str) -> None:
    print(msg, flush=True)


# -- inputs -----------------------------------------------------------------------------------


def make_voice(gen: torch.Generator, num_prompt_tokens: int) -> Voice:
    return Voice(
        prompt_token=torch.randint(0, VOCAB_SIZE, (num_prompt_tokens,), generator=gen),
        prompt_feat=torch.randn(2 * num_prompt_tokens, MEL_BINS, generator=gen) * 2.0 - 6.0,
        embedding=torch.randn(SPK_EMBED_DIM, generator=gen),
    )


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
        tokens = torch.randint(0, VOCAB_SIZE, (n_emit + (3 if streaming else 0),), generator=gen)
        reqs.append(FlowRequest(voice, tokens, 0, not streaming, streaming))
    assert all(r.num_seq_frames == frames for r in reqs), (frames, reqs[0].num_seq_frames)
    return reqs


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
        FlowRequest(voices[v], torch.randint(0, VOCAB_SIZE, (n,), generator=gen), off, fin, st)
        for v, n, off, fin, st in specs
    ]
    dup = reqs[3]
    v = dup.voice
    copy_voice = Voice(v.prompt_token.clone(), v.prompt_feat.clone(), v.embedding.clone())
    reqs.append(
        FlowRequest(copy_voice, dup.tokens.clone(), dup.token_offset, dup.finalize, dup.streaming)
    )
    return reqs


def step_inputs(model: FlowModel, reqs: list[FlowRequest]) -> list:
    """The DiT inputs of one solver step (2B rows) exactly as `FlowModel.generate` builds them."""
    seen: list[list] = []

    def record(*args):
        if not seen:
            seen.append([x.clone() if isinstance(x, torch.Tensor) else x for x in args])
        return model.decoder.estimator(*args)

    model.generate(reqs, estimator=record, to_cpu=False)
    return seen[0]


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def rel_mean(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().mean() / b.abs().mean().clamp(min=1e-12))


def timed_solve(model, reqs, a, *, estimator=None, to_cpu=True, warmup=1) -> parts.Timing:
    """ms per full generate() of `reqs` (`.out`: the last call's mel)."""
    return parts.measure(
        lambda _: model.generate(reqs, estimator=estimator, to_cpu=to_cpu),
        model.device,
        repeats=a.repeats,
        warmup=warmup,
    )


# -- flow-model -------------------------------------------------------------------------------


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


def section_invariance(m32: FlowModel, m16: FlowModel, graphs: bool) -> dict:
    reqs = ragged_requests()
    res: dict = {"frames": [r.num_seq_frames for r in reqs]}
    for name, model, tf32 in (("fp32_tf32_off", m32, False), ("fp32_tf32_on", m32, True)):
        res[name] = {"tf32": parts.set_tf32(tf32)}
        stats, outs = invariance(model, reqs)
        res[name].update(stats)
        if name == "fp32_tf32_off":
            ref = outs
        log(
            f"[invariance] {name:14s} max rel err {stats['max_rel_err']:.2e} "
            f"(<= 1e-4: {stats['pass_1e-4']}), duplicate rows bit-identical: "
            f"{stats['identical_rows_bitwise']}"
        )
    parts.set_tf32(False)
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
    return res


def section_chunking(m32: FlowModel) -> dict:
    parts.set_tf32(False)
    gen = torch.Generator().manual_seed(7)
    voice = make_voice(gen, 75)
    tokens = torch.randint(0, VOCAB_SIZE, (250,), generator=gen)
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
    log(
        f"[chunking] fp32 chunked vs one-shot: {res['chunked_vs_one_shot_max_rel_err']:.2e} "
        f"(chunks as one batch: {res['chunks_batched_vs_one_shot_max_rel_err']:.2e})"
    )
    return res


def _graph_row(row: dict, fn, key: str) -> None:
    try:
        row[key] = fn()
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
        row[f"{key}_error"] = repr(exc)[:300]


def section_step(models: dict, a, graphs: bool, upstream: bool) -> dict:
    res: dict = {"frames": a.frames, "tf32": parts.set_tf32(a.tf32), "ms": {}}
    for name, model in models.items():
        dit = model.decoder.estimator
        graphed = GraphedEstimator(dit) if graphs else None
        for b in a.batches:
            inputs = step_inputs(model, make_requests(b, a.frames, True, seed=1))
            with torch.inference_mode():

                def time_it(est, inputs=inputs, model=model) -> float:
                    timing = parts.measure(
                        lambda _: est(*inputs),
                        model.device,
                        repeats=a.repeats,
                        warmup=a.warmup,
                        events=True,
                    )
                    return timing.median

                eager = time_it(dit)
                row = {"eager": eager, "upstream": UPSTREAM_MS[name].get(b) if upstream else None}
                if graphed is not None:
                    _graph_row(row, lambda: time_it(graphed), "graph")  # noqa: B023
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
    return res


def section_generate(models: dict, a, graphs: bool) -> dict:
    res: dict = {"frames": a.frames, "steps": NUM_STEPS, "tf32": parts.set_tf32(a.tf32), "ms": {}}
    runs = argparse.Namespace(repeats=a.generate_repeats)
    for name, model in models.items():
        graphed = GraphedEstimator(model.decoder.estimator) if graphs else None
        for b in a.batches:
            reqs = make_requests(b, a.frames, True, seed=1)
            row = {"eager": timed_solve(model, reqs, runs).median}
            if graphed is not None:
                _graph_row(
                    row,
                    lambda: timed_solve(model, reqs, runs, estimator=graphed).median,  # noqa: B023
                    "graph",
                )
            res["ms"].setdefault(name, {})[b] = row
            log(
                f"[generate] {name} B={b:3d} eager {row['eager']:8.1f} ms"
                + (f"  graph {row['graph']:8.1f} ms" if "graph" in row else "")
                + f"  ({b * (a.frames // 2 - PROMPT_TOKENS) / 25:g} s of new mel per call)"
            )
        if graphed is not None:
            graphed.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return res


def print_table(results: dict) -> None:
    step, gen, inv = results["step"], results.get("generate"), results.get("invariance")
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
        log(f"\n== ms per generate() (10 steps, B requests of T = {gen['frames']}), TF32 {tf32} ==")
        log(f"{'dtype':5s} {'B':>4s} {'eager':>9s} {'graph':>9s}")
        for name, rows in gen["ms"].items():
            for b, row in rows.items():
                graph = f"{row['graph']:9.1f}" if "graph" in row else f"{'-':>9s}"
                log(f"{name:5s} {b:4d} {row['eager']:9.1f} {graph}")
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
    p = parts.parser(
        "flow-model",
        __doc__,
        dtype="float32,bfloat16",
        repeats=7,
        warmup=2,
        smoke={"batches": [1, 2], "frames": 206, "generate_repeats": 1, "skip": "invariance"},
    )
    p.add_argument("--batches", type=parts.ints, default=[1, 4, 16, 32, 64])
    p.add_argument("--frames", type=int, default=350, help="DiT length of the timed requests")
    p.add_argument("--generate-repeats", type=int, default=3, help="timed generate() calls")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument(
        "--skip",
        default="",
        help="comma list of: invariance,chunking,generate (--smoke skips invariance: 16 "
        "ragged rows in bf16 take a minute on a CPU; --skip '' runs it)",
    )
    p.add_argument("--tf32", action="store_true", help="time fp32 with TF32 on (default off)")
    a = parts.parse(p, argv)
    if sorted(a.dtype) != ["bfloat16", "float32"]:
        p.error("--dtype: flow-model compares float32 with bfloat16; it needs both")
    cuda = torch.device(a.device).type == "cuda"
    graphs = cuda and not a.no_graphs
    upstream = (cuda, a.preset, a.frames, a.model_dir) == (True, parts.PRESET, 350, None)
    skip = set(filter(None, a.skip.split(",")))
    t_start = time.perf_counter()
    results: dict = {
        "env": {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "preset": a.preset,
            "weights": a.model_dir or f"random, seed {a.seed}",
        }
    }
    log(f"{results['env']}")
    torch.set_grad_enabled(False)
    m32 = load_flow(a.model_dir, preset=a.preset, seed=a.seed).to(a.device)
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    results["env"]["params"] = sum(x.numel() for x in m32.parameters())
    log(f"built {a.preset}: {results['env']['params']:,} parameters")

    def section(key: str, fn) -> None:
        results[key] = fn()
        parts.save(a, results, "flow_model_gpu")

    if "invariance" not in skip:
        section("invariance", lambda: section_invariance(m32, m16, graphs))
    if "chunking" not in skip:
        section("chunking", lambda: section_chunking(m32))
    models = {"fp32": m32, "bf16": m16}
    section("step", lambda: section_step(models, a, graphs, upstream))
    if "generate" not in skip:
        section("generate", lambda: section_generate(models, a, graphs))
    print_table(results)
    results["env"]["total_s"] = time.perf_counter() - t_start
    parts.save(a, results, "flow_model_gpu")
    log(
        f"\ntotal {results['env']['total_s']:.0f} s; tf32 was set explicitly per section (see JSON)"
    )
    return 0
