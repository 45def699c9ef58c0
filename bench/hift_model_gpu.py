"""GPU check and benchmark of the Stage-2 causal HiFT model (issue 4).

Run from the repo root on a CUDA machine (torch + numpy only):

    python -m bench hift-model            # ~1-2 min on an H100/H200

Full-size preset (cosyvoice3-0.5b, 20.8M parameters) with seeded random weights (weight-norm
g != ||v||, random Snake alphas), fp32 with TF32 off everywhere. It measures:

  1. exactness: incremental sessions vs the full-history decode (invariant 3, <= 1e-3 abs):
     >= 60 s with upstream's 50/100/200/200/... frame schedule (flushed, and held back without
     flush), plus a random ragged schedule with 1-frame chunks, plus batched vs solo;
  2. latency: ms per 100-frame chunk for a session at 1 s, 10 s and 60 s of history, against a
     full re-decode of the whole history (upstream's way, linear in history);
  3. throughput: audio seconds per wall second for 1, 8, 32 sessions stepped together, each
     with 100-frame chunks (upstream's HiFT: 21.5 ms per 100 frames for one stream, 100 ms for
     32 equal-length streams on the same card);
  4. the phase formulation: "exact" (float64, default) vs "upstream" (float32 phase as
     upstream's CPU cumsum) on the same weights, at 10 s and 60 s.

Prints a table; writes every figure to $OUT/hift_model_gpu.json when $OUT is set.
`--smoke` runs the same code on CPU with the small preset and short lengths (a syntax and
logic check for machines without a GPU; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import time

import torch

from bench.gpu import save_json
from token2wav import SAMPLES_PER_FRAME
from vocoder_service.model import (
    HIFT_PRESETS,
    HOLDBACK_FRAMES,
    MEL_BINS,
    SAMPLE_RATE,
    HiFTSessionState,
    load_hift,
)

FRAMES_PER_S = SAMPLE_RATE // SAMPLES_PER_FRAME  # 50
CHUNK = 100  # frames per timed chunk (2 s of audio)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--smoke", action="store_true", help="CPU, small preset: a logic check, not a measurement"
    )
    return p


def _configure(smoke: bool) -> None:
    """The run's sizes, module-wide: the full run's at import, --smoke's when main asks."""
    global SMOKE, PRESET, DEVICE, HISTORIES_S, BATCH_SIZES, LONG_S, REPEATS, WARMUP
    SMOKE = smoke
    PRESET = "small" if smoke else "cosyvoice3-0.5b"
    DEVICE = torch.device("cpu" if smoke else "cuda")
    HISTORIES_S = (1, 3) if smoke else (1, 10, 60)
    BATCH_SIZES = (1, 3) if smoke else (1, 8, 32)
    LONG_S = 6 if smoke else 60  # the exactness and phase-mode length
    REPEATS = 1 if smoke else 15
    WARMUP = 0 if smoke else 3


_configure(False)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int = REPEATS, warmup: int = WARMUP, setup=None) -> float:
    """Median milliseconds of fn(setup()) over `repeats` after `warmup` calls; CUDA-synchronised
    wall time, or the CUDA-event time when larger (the step returns CPU audio, so it
    synchronises itself anyway)."""
    if SMOKE:
        repeats, warmup = 1, 0
    cuda = DEVICE.type == "cuda"
    times = []
    for i in range(warmup + repeats):
        arg = setup() if setup else None
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn(arg)
        if cuda:
            end.record()
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        if cuda:
            ms = max(ms, start.elapsed_time(end))
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def make_mel(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(MEL_BINS, frames, generator=g) - 5  # log-mel-like level


def upstream_schedule(total: int) -> list[int]:
    """Upstream's mel chunks for a 0-pad prompt: 50, 100, 200, 200, ... (hop 25 -> 50 -> 100)."""
    sizes, n, hop = [], 0, 50
    while n < total:
        sizes.append(min(hop, total - n))
        n += sizes[-1]
        hop = min(2 * hop, 200)
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


def exactness(model, res: dict) -> None:
    frames = LONG_S * FRAMES_PER_S + 37
    mel = make_mel(frames, seed=1)
    full = model.decode(mel, finalize=True)
    held_full = model.decode(mel, finalize=False)
    sizes = upstream_schedule(frames)
    res["exact_long_flushed_max_abs"] = max_err(stream(model, mel, sizes, True), full)
    res["exact_long_held_back_max_abs"] = max_err(stream(model, mel, sizes, False), held_full)
    rng = random.Random(2)
    ragged = [1] * 60 + [rng.randint(1, 120) for _ in range(200)]
    total = (4 if SMOKE else 20) * FRAMES_PER_S
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


def latency(model, res: dict) -> None:
    for hist_s in HISTORIES_S:
        h = hist_s * FRAMES_PER_S
        mel = make_mel(h + CHUNK, seed=20 + hist_s)
        st = model.new_session()
        for pos in range(0, h, 200):
            model.decode_one(st, mel[:, pos : min(pos + 200, h)], False)
        blob = st.to_bytes()
        chunk = mel[:, h:]
        res[f"session_ms_per_100f_hist{hist_s}s"] = timed(
            lambda s, chunk=chunk: model.decode_one(s, chunk, False),
            setup=lambda blob=blob: HiFTSessionState.from_bytes(blob),
        )
        res[f"redecode_ms_per_100f_hist{hist_s}s"] = timed(
            lambda _, mel=mel: model.decode(mel, finalize=False), repeats=5, warmup=1
        )


def throughput(model, res: dict, tag: str = "") -> None:
    steps = 5
    for n in BATCH_SIZES:
        mels = [make_mel(500 + steps * CHUNK + 10, seed=100 + i) for i in range(n)]
        states = [model.new_session() for _ in range(n)]
        model.decode_batch(states, [m[:, :500] for m in mels], [False] * n)  # 10 s of history each
        blobs = [st.to_bytes() for st in states]

        def run(sts, mels=mels, n=n):
            for k in range(steps):
                lo = 500 + k * CHUNK
                model.decode_batch(sts, [m[:, lo : lo + CHUNK] for m in mels], [False] * n)

        ms = timed(
            run,
            repeats=5,
            warmup=1,
            setup=lambda blobs=blobs: [HiFTSessionState.from_bytes(b) for b in blobs],
        )
        audio_s = n * steps * CHUNK / FRAMES_PER_S
        res[f"{tag}batch{n}_ms_per_step"] = ms / steps
        res[f"{tag}batch{n}_audio_s_per_wall_s"] = audio_s / (ms / 1e3)


def phase_modes(model, res: dict) -> None:
    cfg = dataclasses.replace(HIFT_PRESETS[PRESET], phase_mode="upstream")
    upstream_like = load_hift(None, device=model.device, config=cfg)  # same seed: same weights
    for secs in (10, LONG_S):
        mel = make_mel(secs * FRAMES_PER_S, seed=30 + secs)
        a, b = model.decode(mel, True), upstream_like.decode(mel, True)
        res[f"phase_exact_vs_upstream_{secs}s_max_abs"] = max_err(a, b)
        res[f"phase_exact_vs_upstream_{secs}s_snr_db"] = snr_db(b, a)


def main(argv: list[str] | None = None) -> int:
    _configure(_parser().parse_args(argv).smoke)
    if not SMOKE and not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke for a CPU logic check)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    dev = DEVICE
    t_start = time.perf_counter()
    model = load_hift(None, device=dev, preset=PRESET)
    res: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "preset": PRESET,
        "dtype": "float32, TF32 off",
        "context_frames": model.cfg.context_frames(),
        "holdback_frames": HOLDBACK_FRAMES,
    }
    exactness(model, res)
    latency(model, res)
    throughput(model, res)
    phase_modes(model, res)
    bf16 = load_hift(None, device=dev, preset=PRESET, dtype=torch.bfloat16)
    throughput(bf16, res, tag="bf16_")
    mel = make_mel((2 if SMOKE else 10) * FRAMES_PER_S, seed=40)
    res["bf16_vs_fp32_max_abs"] = max_err(bf16.decode(mel, True), model.decode(mel, True))
    res["peak_gpu_mem_gib"] = (
        torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    )
    res["total_s"] = time.perf_counter() - t_start
    report(res)
    save_json("hift_model_gpu.json", res)
    ok = all(res[k] <= 1e-3 for k in res if k.startswith("exact_"))
    return 0 if ok else 1


def report(r: dict) -> None:
    print(f"\nHiFT {r['preset']} on {r['device']}, torch {r['torch']}, {r['dtype']}")
    print(f"window {r['context_frames']} frames of context, holdback {r['holdback_frames']}")
    print("\nexactness (max abs, invariant 3 needs <= 1e-3)")
    print(f"  (long = {LONG_S} s with the upstream schedule, ragged = 1-frame then random chunks)")
    for k in ("exact_long_flushed", "exact_long_held_back", "exact_ragged", "batched_vs_solo"):
        print(f"  {k:<28} {r[k + '_max_abs']:.2e}")
    print("\nms per 100-frame chunk      session   full re-decode")
    for h in HISTORIES_S:
        s, d = r[f"session_ms_per_100f_hist{h}s"], r[f"redecode_ms_per_100f_hist{h}s"]
        print(f"  history {h:>3} s             {s:8.2f}   {d:8.2f}")
    print("\nbatched sessions, 100-frame chunks   ms/step   audio s per wall s")
    for tag, name in (("", "fp32"), ("bf16_", "bf16")):
        for n in BATCH_SIZES:
            ms, x = r[f"{tag}batch{n}_ms_per_step"], r[f"{tag}batch{n}_audio_s_per_wall_s"]
            print(f"  {name} x{n:<3}                        {ms:8.2f}   {x:10.1f}")
    print("  (upstream HiFT on this card per the issue: 21.5 ms / 100 frames x1, 100 ms x32)")
    print("\nphase 'exact' (float64) vs 'upstream' (float32 CPU cumsum), same weights")
    for s in (10, LONG_S):
        print(
            f"  {s:>2} s: max abs {r[f'phase_exact_vs_upstream_{s}s_max_abs']:.2e}, "
            f"SNR {r[f'phase_exact_vs_upstream_{s}s_snr_db']:.1f} dB"
        )
    print(f"\nbf16 vs fp32 max abs {r['bf16_vs_fp32_max_abs']:.2e}")
    print(f"peak GPU memory {r['peak_gpu_mem_gib']:.2f} GiB, total {r['total_s']:.0f} s")
