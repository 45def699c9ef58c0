r"""The Stage-2 causal HiFT alone, random weights (seeded; weight-norm g != ||v||, random Snake
alphas): exactness and timing.

    python -m bench hift-model          # ~1-2 min on an H100/H200
    python -m bench vocoder-latency     # ~1 min on an H200
    python -m bench hift-model --smoke  # CPU, small preset, short lengths (also vocoder-latency)

hift-model, fp32 with TF32 off everywhere (writes OUT/hift_model_gpu.json):
  1. exactness: incremental sessions vs the full-history decode (invariant 3, <= 1e-3 abs):
     --long-s seconds with upstream's 50/100/200/200/... frame schedule (flushed, and held back
     without flush), plus a random ragged schedule with 1-frame chunks, plus batched vs solo;
  2. latency: ms per 100-frame chunk for a session at each of --histories seconds of history,
     against a full re-decode of the whole history (upstream's way, linear in history);
  3. throughput: audio seconds per wall second for --batches sessions stepped together, each
     with 100-frame chunks, fp32 and bf16 (upstream's HiFT: 21.5 ms per 100 frames for one
     stream, 100 ms for 32 equal-length streams on the same card);
  4. the phase formulation: "exact" (float64, default) vs "upstream" (float32 phase as
     upstream's CPU cumsum) on the same weights, at 10 s (or less) and --long-s.

vocoder-latency (writes OUT/vocoder_latency_gpu.json): a vocoder batch as the service runs it
(`HiFTRunner.execute`: inference mode on its own CUDA stream, host prep, f0 predictor, decoder,
audio back on the host), for the four shapes that set single-stream and loaded latency:
    first x1     1 session,   its first chunk (50 mel frames, upstream's schedule)
    100f x1      1 session,   a 100-frame chunk after the first
    first xN     N sessions (--sessions), each a first chunk (a burst of new streams)
    100f xN      N sessions, each a 100-frame chunk
For each dtype (torch's default TF32 settings, as the service runs): median and p90 ms per batch
with the service's --cuda-graphs off (eager, unpadded) and on (the model `load_model` builds:
Snake in 4 kernels, the default shape buckets, every graph captured by the runner's warm-up
before timing), the max abs difference of the audio between off and on, and, for the eager
path, the GPU kernels of one profiled batch and their summed GPU time: kernel time far below
the wall time means the batch is launch-bound. On the CPU the service ignores --cuda-graphs,
so off and on are the same path there.
"""

from __future__ import annotations

import math
import random
import time

import numpy as np
import torch

from bench import parts
from gateway.schedule import ScheduleConfig
from token2wav import SAMPLES_PER_FRAME, TOKEN_MEL_RATIO
from vocoder_service.config import ModelConfig
from vocoder_service.model import (
    HIFT_PRESETS,
    HOLDBACK_FRAMES,
    MEL_BINS,
    SAMPLE_RATE,
    HiFTSessionState,
    load_hift,
)
from vocoder_service.runner import HiFTRunner
from vocoder_service.service import load_model

FRAMES_PER_S = SAMPLE_RATE // SAMPLES_PER_FRAME  # 50
CHUNK = 100  # frames per timed chunk (2 s of audio)
# Upstream's mel chunks: the gateway's hops in tokens (25, 50, 100, 100, ...) in mel frames.
UPSTREAM_HOPS = tuple(TOKEN_MEL_RATIO * h for h in ScheduleConfig().hops(3))  # 50, 100, 200
FIRST, LATER = UPSTREAM_HOPS[0], UPSTREAM_HOPS[1]


def make_mel(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(MEL_BINS, frames, generator=g) - 5  # log-mel-like level


def upstream_schedule(total: int) -> list[int]:
    """Upstream's mel chunks for a 0-pad prompt: 50, 100, 200, 200, ... until `total`."""
    sizes, n = [], 0
    while n < total:
        hop = UPSTREAM_HOPS[min(len(sizes), len(UPSTREAM_HOPS) - 1)]
        sizes.append(min(hop, total - n))
        n += sizes[-1]
    return sizes


def stream(model, mel, sizes, finalize_last: bool) -> torch.Tensor:
    st, outs, pos = model.new_session(), [], 0
    for i, n in enumerate(sizes):
        outs.append(
            model.decode_one(st, mel[:, pos : pos + n], finalize_last and i == len(sizes) - 1)
        )
        pos += n
    return torch.cat(outs)


def batched_and_solo(model, mels, history, chunk, finalize):
    """The same chunks (`chunk[i]` frames of `mels[i]` after its first `history[i]`) through one
    batched call and through one call per session, from sessions that have already taken their
    history: (batched audio, solo audio, batched states, solo states)."""

    def sessions():
        out = []
        for mel, h in zip(mels, history):
            st = model.new_session()
            if h:
                model.decode_one(st, mel[:, :h], False)
            out.append(st)
        return out

    batch_states, solo_states = sessions(), sessions()
    new = [mel[:, h : h + n] for mel, h, n in zip(mels, history, chunk)]
    batched = model.decode_batch(batch_states, new, finalize)
    solo = [model.decode_one(st, x, f) for st, x, f in zip(solo_states, new, finalize)]
    return batched, solo, batch_states, solo_states


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.double() - b.double()).abs().max())


def snr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    noise = float(((ref.double() - test.double()) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((ref.double() ** 2).sum()) / noise)


# -- hift-model -------------------------------------------------------------------------------


def exactness(model, a, res: dict) -> None:
    frames = a.long_s * FRAMES_PER_S + 37
    mel = make_mel(frames, seed=1)
    full = model.decode(mel, finalize=True)
    held_full = model.decode(mel, finalize=False)
    sizes = upstream_schedule(frames)
    res["exact_long_flushed_max_abs"] = max_err(stream(model, mel, sizes, True), full)
    res["exact_long_held_back_max_abs"] = max_err(stream(model, mel, sizes, False), held_full)
    rng = random.Random(2)
    ragged = [1] * 60 + [rng.randint(1, 120) for _ in range(200)]
    total = min(20, max(4, a.long_s - 2)) * FRAMES_PER_S
    cut, acc = [], 0
    for n in ragged:
        if acc >= total:
            break
        cut.append(min(n, total - acc))
        acc += cut[-1]
    mel20 = make_mel(total, seed=3)
    res["exact_ragged_max_abs"] = max_err(
        stream(model, mel20, cut, True), model.decode(mel20, finalize=True)
    )
    # Batched vs solo: 8 sessions at different histories, ragged chunks, some finalizing.
    mels = [make_mel(800, seed=10 + i) for i in range(8)]
    hist = [0, 3, 40, 90, 200, 333, 500, 640]
    chunk = [50, 1, 100, 7, 200, 64, 150, 100]
    fins = [False, True, False, False, True, False, True, False]
    batched, solo, _, _ = batched_and_solo(model, mels, hist, chunk, fins)
    res["batched_vs_solo_max_abs"] = max(max_err(x, y) for x, y in zip(batched, solo) if x.numel())


def _slow(a) -> dict:
    """Repeats of the slow measurements (full re-decodes, five batched steps): at most 5."""
    return {"repeats": min(a.repeats, 5), "warmup": min(a.warmup, 1)}


def latency(model, a, res: dict) -> None:
    for hist_s in a.histories:
        h = hist_s * FRAMES_PER_S
        mel = make_mel(h + CHUNK, seed=20 + hist_s)
        st = model.new_session()
        for pos in range(0, h, 200):
            model.decode_one(st, mel[:, pos : min(pos + 200, h)], False)
        blob = st.to_bytes()
        chunk = mel[:, h:]
        res[f"session_ms_per_100f_hist{hist_s}s"] = parts.measure(
            lambda s, chunk=chunk: model.decode_one(s, chunk, False),
            model.device,
            repeats=a.repeats,
            warmup=a.warmup,
            setup=lambda blob=blob: HiFTSessionState.from_bytes(blob),
        ).median
        res[f"redecode_ms_per_100f_hist{hist_s}s"] = parts.measure(
            lambda _, mel=mel: model.decode(mel, finalize=False), model.device, **_slow(a)
        ).median


def throughput(model, a, res: dict, tag: str = "") -> None:
    steps = 5
    for n in a.batches:
        mels = [make_mel(500 + steps * CHUNK + 10, seed=100 + i) for i in range(n)]
        states = [model.new_session() for _ in range(n)]
        model.decode_batch(states, [m[:, :500] for m in mels], [False] * n)  # 10 s of history each
        blobs = [st.to_bytes() for st in states]

        def run(sts, mels=mels, n=n):
            for k in range(steps):
                lo = 500 + k * CHUNK
                model.decode_batch(sts, [m[:, lo : lo + CHUNK] for m in mels], [False] * n)

        ms = parts.measure(
            run,
            model.device,
            setup=lambda blobs=blobs: [HiFTSessionState.from_bytes(b) for b in blobs],
            **_slow(a),
        ).median
        audio_s = n * steps * CHUNK / FRAMES_PER_S
        res[f"{tag}batch{n}_ms_per_step"] = ms / steps
        res[f"{tag}batch{n}_audio_s_per_wall_s"] = audio_s / (ms / 1e3)


def phase_seconds(a) -> list[int]:
    return sorted({min(10, a.long_s), a.long_s})


def phase_modes(model, a, res: dict) -> None:
    upstream_like = load_hift(  # the same weights (loaded, or the same seed)
        a.model_dir, device=model.device, preset=a.preset, seed=a.seed, phase_mode="upstream"
    )
    for secs in phase_seconds(a):
        mel = make_mel(secs * FRAMES_PER_S, seed=30 + secs)
        x, y = model.decode(mel, True), upstream_like.decode(mel, True)
        res[f"phase_exact_vs_upstream_{secs}s_max_abs"] = max_err(x, y)
        res[f"phase_exact_vs_upstream_{secs}s_snr_db"] = snr_db(y, x)


def main(argv: list[str] | None = None) -> int:
    p = parts.parser(
        "hift-model",
        __doc__,
        dtype="float32,bfloat16",
        repeats=15,
        warmup=3,
        smoke={"histories": [1, 3], "batches": [1, 3], "long_s": 6},
    )
    p.add_argument("--histories", type=parts.ints, default=[1, 10, 60], help="s of session history")
    p.add_argument(
        "--batches", type=parts.ints, default=[1, 8, 32], help="sessions stepped together"
    )
    p.add_argument("--long-s", type=int, default=60, help="s of the exactness and phase runs")
    a = parts.parse(p, argv)
    if a.dtype != ["float32", "bfloat16"]:
        p.error("--dtype: hift-model measures float32, then bfloat16 against it; it needs both")
    if a.preset not in HIFT_PRESETS:
        p.error(f"--preset: want one of {', '.join(HIFT_PRESETS)}, got {a.preset!r}")
    parts.set_tf32(False)
    torch.backends.cudnn.benchmark = False
    cuda = torch.device(a.device).type == "cuda"
    t_start = time.perf_counter()
    model = load_hift(a.model_dir, device=a.device, preset=a.preset, seed=a.seed)
    res: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "preset": a.preset,
        "dtype": "float32, TF32 off",
        "context_frames": model.cfg.context_frames(),
        "holdback_frames": HOLDBACK_FRAMES,
    }
    exactness(model, a, res)
    latency(model, a, res)
    throughput(model, a, res)
    phase_modes(model, a, res)
    bf16 = load_hift(
        a.model_dir, device=a.device, preset=a.preset, dtype=torch.bfloat16, seed=a.seed
    )
    throughput(bf16, a, res, tag="bf16_")
    mel = make_mel(min(10, a.long_s // 3) * FRAMES_PER_S, seed=40)
    res["bf16_vs_fp32_max_abs"] = max_err(bf16.decode(mel, True), model.decode(mel, True))
    res["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    res["total_s"] = time.perf_counter() - t_start
    report(res, a)
    parts.save(a, res, "hift_model_gpu")
    ok = all(res[k] <= 1e-3 for k in res if k.startswith("exact_"))
    return 0 if ok else 1


def report(r: dict, a) -> None:
    print(f"\nHiFT {r['preset']} on {r['device']}, torch {r['torch']}, {r['dtype']}")
    print(f"window {r['context_frames']} frames of context, holdback {r['holdback_frames']}")
    print("\nexactness (max abs, invariant 3 needs <= 1e-3)")
    print(
        f"  (long = {a.long_s} s with the upstream schedule, ragged = 1-frame then random chunks)"
    )
    for k in ("exact_long_flushed", "exact_long_held_back", "exact_ragged", "batched_vs_solo"):
        print(f"  {k:<28} {r[k + '_max_abs']:.2e}")
    print("\nms per 100-frame chunk      session   full re-decode")
    for h in a.histories:
        s, d = r[f"session_ms_per_100f_hist{h}s"], r[f"redecode_ms_per_100f_hist{h}s"]
        print(f"  history {h:>3} s             {s:8.2f}   {d:8.2f}")
    print("\nbatched sessions, 100-frame chunks   ms/step   audio s per wall s")
    for tag, name in (("", "fp32"), ("bf16_", "bf16")):
        for n in a.batches:
            ms, x = r[f"{tag}batch{n}_ms_per_step"], r[f"{tag}batch{n}_audio_s_per_wall_s"]
            print(f"  {name} x{n:<3}                        {ms:8.2f}   {x:10.1f}")
    print("  (upstream HiFT on this card per the issue: 21.5 ms / 100 frames x1, 100 ms x32)")
    print("\nphase 'exact' (float64) vs 'upstream' (float32 CPU cumsum), same weights")
    for s in phase_seconds(a):
        print(
            f"  {s:>2} s: max abs {r[f'phase_exact_vs_upstream_{s}s_max_abs']:.2e}, "
            f"SNR {r[f'phase_exact_vs_upstream_{s}s_snr_db']:.1f} dB"
        )
    print(f"\nbf16 vs fp32 max abs {r['bf16_vs_fp32_max_abs']:.2e}")
    print(f"peak GPU memory {r['peak_gpu_mem_gib']:.2f} GiB, total {r['total_s']:.0f} s")


# -- vocoder-latency --------------------------------------------------------------------------


def cases(many: int) -> tuple:
    return (  # name, sessions, frames each session has already taken, chunk frames
        ("first x1", 1, 0, FIRST),
        ("100f x1", 1, FIRST, LATER),
        (f"first x{many}", many, 0, FIRST),
        (f"100f x{many}", many, FIRST, LATER),
    )


def execute(runner: HiFTRunner, states, chunks) -> list[np.ndarray]:
    out = runner.execute(states, chunks, [False] * len(chunks))  # synchronises its stream
    bad = [e for e in out.errors if e is not None]
    if bad:
        raise RuntimeError(f"vocoder batch failed: {bad[0]!r}")
    return out.audio


def case_inputs(runner: HiFTRunner, rows: int, history: int, chunk: int):
    """Session blobs after `history` frames, and the chunk each session gets next."""
    mels = [make_mel(history + chunk, seed=100 + i).numpy() for i in range(rows)]
    states = [runner.new_state() for _ in range(rows)]
    if history:
        execute(runner, states, [m[:, :history] for m in mels])
    return [st.to_bytes() for st in states], [np.ascontiguousarray(m[:, history:]) for m in mels]


def time_batch(runner: HiFTRunner, blobs, chunks, a) -> parts.Timing:
    return parts.measure(
        lambda states: execute(runner, states, chunks),
        runner.device,
        repeats=a.repeats,
        warmup=a.warmup,
        setup=lambda: [HiFTSessionState.from_bytes(b) for b in blobs],
    )


def kernel_profile(runner: HiFTRunner, blobs, chunks) -> tuple[int, float]:
    """(GPU kernels, their summed ms) of one batch; (0, 0) on the CPU."""
    if runner.device.type != "cuda":
        return 0, 0.0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        execute(runner, [HiFTSessionState.from_bytes(b) for b in blobs], chunks)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), sum(e.time_range.elapsed_us() for e in kernels) / 1e3


def measure_dtype(dtype: str, a, res: dict) -> None:
    def runner(graphs: bool) -> HiFTRunner:
        cfg = ModelConfig(
            preset=a.preset, model_dir=a.model_dir, device=a.device, dtype=dtype, cuda_graphs=graphs
        )
        r = HiFTRunner(load_model(cfg), a.device)
        r.warmup()  # the service's: with graphs on, every graph captured before serving
        return r

    off, on = runner(False), runner(True)
    short = parts.SHORT[dtype]
    for name, rows, history, chunk in cases(a.sessions):
        blobs, chunks = case_inputs(off, rows, history, chunk)
        t_off = time_batch(off, blobs, chunks, a)
        n_kernels, kernel_ms = kernel_profile(off, blobs, chunks)
        t_on = time_batch(on, blobs, chunks, a)
        diff = max(float(np.abs(x - y).max()) for x, y in zip(t_on.out, t_off.out) if x.size)
        res[f"{short} {name}"] = {
            "off_p50_ms": t_off.median,
            "off_p90_ms": t_off.p90,
            "on_p50_ms": t_on.median,
            "on_p90_ms": t_on.p90,
            "max_abs_diff": diff,
            "eager_kernels": n_kernels,
            "eager_kernel_ms": kernel_ms,
        }
    graphed = getattr(on.model, "graphed_core", None)
    if graphed is not None:
        res[f"{short} graphs"] = len(graphed)


def latency_main(argv: list[str] | None = None) -> int:
    p = parts.parser(
        "vocoder-latency",
        __doc__,
        dtype="float32,bfloat16",
        repeats=20,
        warmup=3,
        smoke={"sessions": 3},
    )
    p.add_argument("--sessions", type=int, default=24, help="N of the loaded cases")
    a = parts.parse(p, argv)
    cuda = torch.device(a.device).type == "cuda"
    start = time.perf_counter()
    res: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (no graphs)",
        "torch": torch.__version__,
        "preset": a.preset,
        "tf32_conv": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
    for dtype in a.dtype:
        measure_dtype(dtype, a, res)
    if cuda:
        res["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["total_s"] = time.perf_counter() - start
    latency_report(res, a)
    parts.save(a, res, "vocoder_latency_gpu")
    return 0


def latency_report(r: dict, a) -> None:
    print(f"\nHiFT {r['preset']} on {r['device']}, torch {r['torch']}")
    print(f"cuDNN TF32 {r['tf32_conv']}, cudnn.benchmark {r['cudnn_benchmark']}")
    print("ms per vocoder batch (as HiFTRunner.execute), --cuda-graphs off vs on")
    head = "  {:<16} {:>9} {:>9} {:>9} {:>9} {:>7} {:>10} {:>8} {:>9}"
    print(head.format("case", "off p50", "off p90", "on p50", "on p90", "speedup", "max diff",
                      "kernels", "kernel ms"))  # fmt: skip
    for dtype in a.dtype:
        short = parts.SHORT[dtype]
        for name, *_ in cases(a.sessions):
            c = r[f"{short} {name}"]
            print(
                f"  {short + ' ' + name:<16} {c['off_p50_ms']:9.2f} {c['off_p90_ms']:9.2f} "
                f"{c['on_p50_ms']:9.2f} {c['on_p90_ms']:9.2f} "
                f"{c['off_p50_ms'] / c['on_p50_ms']:6.2f}x {c['max_abs_diff']:10.2e} "
                f"{c['eager_kernels']:8d} {c['eager_kernel_ms']:9.2f}"
            )
    print("  (kernels, kernel ms: GPU kernels of one eager batch and their summed GPU time)")
    shorts = [parts.SHORT[d] for d in a.dtype]
    held = ", ".join(f"{s} {r[k]}" for s in shorts if (k := f"{s} graphs") in r)
    if held:
        print(f"graphs held: {held}")
    if "peak_gpu_mem_gib" in r:
        print(f"peak GPU memory {r['peak_gpu_mem_gib']:.2f} GiB")
    print(f"total {r['total_s']:.0f} s")
