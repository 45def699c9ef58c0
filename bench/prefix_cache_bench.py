"""The flow prefix cache (issue 17) on one GPU: work per utterance, then Generate-only
throughput, each with the cache on and off.

    python -m bench prefix-cache            # H200: full size, bf16, ~6 min
    python -m bench prefix-cache --smoke    # CPU, small preset, fp32

Part 1, per utterance (3 s prompt; 10 s and 30 s of speech, the gateway's schedule; each call
run alone and eagerly, in order): DiT frame-steps computed (frames through the blocks x solver
steps) with the cache off and on, lookups hit, cache bytes at the peak, and how far the cached
mel is from the recomputed one (max |diff| / max |mel|, per dtype).

Part 2, Generate-only over gRPC (bench/flow_service_bench.py's closed loop) at --streams
streams, cache off and then on, for each utterance length: frame-steps/s (upstream-equivalent:
real sequence frames x steps, whatever was reused), audio s/s, the cache's hit rate, reused
frame share, bytes and evictions. Each stream keeps up to --max-inflight (4, the gateway's
default) of its calls in flight; with the cache on, the flow engine runs them in stream order
(FlowEngine.submit), with it off they run side by side, as deployed.

Random weights unless --model-dir (speed and exactness only). Writes
OUT/prefix_cache_bench.json after every run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time

import torch

from bench import flow_service_bench as fsb
from bench import parts
from bench.workload import TOKEN_RATE, make_bench_voice, make_tokens
from flow_service.model import NUM_STEPS, FlowRequest, PrefixCache, Voice, load_flow


def requests_for(voice: Voice, tokens: torch.Tensor, prompt_tokens: int, key: str):
    for c in fsb.plan_calls(prompt_tokens, len(tokens)):
        yield FlowRequest(
            voice, tokens[: c.num_tokens], c.token_offset, c.finalize, c.streaming, key
        )


def per_utterance(model, a, seconds: int) -> dict:
    vd = make_bench_voice(a.seed, 0, a.prompt_tokens)
    voice = Voice(
        torch.from_numpy(vd.prompt_token.copy()),
        torch.from_numpy(vd.prompt_feat.copy()),
        torch.from_numpy(vd.embedding.copy()),
    )
    tokens = torch.from_numpy(make_tokens(a.seed, seconds, seconds * TOKEN_RATE))
    calls = list(requests_for(voice, tokens, a.prompt_tokens, f"utt-{seconds}"))
    model.generate([calls[0]])  # lazy initialisation outside the timings
    cache = PrefixCache.for_model(model, a.part1_cache_mb << 20)
    off_frames = sum(c.num_seq_frames for c in calls)
    worst, peak = 0.0, 0
    times = {"off": 0.0, "on": 0.0}
    for c in calls:
        for mode in ("off", "on"):
            use = cache if mode == "on" else None
            (out,), ms = parts.once(lambda: model.generate([c], prefix_cache=use), model.device)  # noqa: B023
            times[mode] += ms / 1e3
            if mode == "off":
                ref = out
        worst = max(worst, float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-6)))
        peak = max(peak, cache.bytes_used)
    s = cache.stats
    lookups = s["hits"] + s["voice_hits"] + s["misses"]
    return dict(
        seconds=seconds,
        calls=[c.num_seq_frames for c in calls],
        frame_steps_off=off_frames * NUM_STEPS,
        frame_steps_on=s["computed_frames"] * NUM_STEPS,
        hits=s["hits"],
        voice_hits=s["voice_hits"],
        misses=s["misses"],
        hit_rate=round((s["hits"] + s["voice_hits"]) / lookups, 3) if lookups else None,
        peak_cache_bytes=peak,
        cache_bytes_after_final=cache.bytes_used,
        max_rel_diff_on_vs_off=worst,
        solo_eager_s={k: round(v, 3) for k, v in times.items()},
    )


def generate_only(model, a, seconds: int, cache_on: bool, save) -> dict:
    flags = [
        f"--concurrency={a.streams}",
        f"--utterances={a.utterances}",
        f"--prompt-tokens={a.prompt_tokens}",
        f"--utterance-tokens={seconds * TOKEN_RATE}",
        f"--max-inflight={a.max_inflight}",
        f"--device={a.device}",
        f"--dtype={a.dtype}",
        f"--preset={a.preset}",
        f"--seed={a.seed}",
        f"--out={a.out}",
        f"--flow-arg=--prefix-cache-mb={a.cache_mb if cache_on else 0}",
        *a.flow_arg,
    ]
    args = fsb.parse_args(flags)
    gc.collect()  # the previous server's cache: its memory back before the auto budget is read
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    rows = asyncio.run(fsb.run_mode(model, args, True, lambda row: None))
    row = dict(rows[-1], cache="on" if cache_on else "off", seconds=seconds)
    save(row)
    pc = row.get("prefix_cache") or {}
    print(
        f"{seconds:3d} s utterances, {a.streams} streams, cache {row['cache']:3}: "
        f"{row['frame_steps_per_s']:>10.0f} frame-steps/s {row['audio_s_per_s']:8.2f} audio s/s"
        f"  hit rate {pc.get('hit_rate')}  reused {pc.get('reused_frame_share')}  "
        f"bytes {pc.get('bytes')}  evictions {pc.get('evictions')}  errors {row['errors'] or 0}",
        flush=True,
    )
    return row


def parse_args(argv=None) -> argparse.Namespace:
    p = parts.parser(
        "prefix-cache",
        __doc__,
        smoke={"dtype": ["float32"], "seconds": "4,6", "streams": 3, "part1_cache_mb": 256},
    )
    p.add_argument("--seconds", default="10,30", help="utterance lengths (s), comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=75)
    p.add_argument("--streams", type=int, default=64, help="Generate-only concurrency")
    p.add_argument("--utterances", type=int, default=1, help="per stream, Generate-only")
    p.add_argument("--max-inflight", type=int, default=4, help="calls in flight per stream")
    p.add_argument(
        "--cache-mb", type=int, default=-1, help="--prefix-cache-mb of the server (-1 auto)"
    )
    p.add_argument("--part1-cache-mb", type=int, default=16384, help="cache budget, part 1")
    p.add_argument("--skip-generate", action="store_true", help="part 1 only")
    p.add_argument(
        "--fp32-check",
        type=lambda v: v.lower() in ("1", "true", "yes", "on"),
        default=True,
        help="also run part 1's first length in fp32 with TF32 off (exactness), default true",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="skip a Generate-only run whose estimated end is past this many seconds",
    )
    p.add_argument("--flow-arg", action="append", default=[], metavar="FLAG")
    a = parts.parse(p, argv)
    a.dtype = parts.one_dtype(p, a)
    a.seconds = [int(x) for x in str(a.seconds).split(",")]
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    parts.cpu_threads(a.device)
    dtype = parts.DTYPES[a.dtype]
    model = load_flow(a.model_dir, device=a.device, dtype=dtype, preset=a.preset, seed=a.seed)
    result = parts.record(a, per_utterance=[], generate_only=[], skipped=[])
    started = time.perf_counter()

    def write() -> None:
        parts.save(a, result, "prefix_cache_bench")

    def part1(m, label: str, seconds: int) -> None:
        row = dict(per_utterance(m, a, seconds), dtype=label)
        result["per_utterance"].append(row)
        write()
        print(
            f"{seconds:3d} s utterance, calls of {row['calls']} frames: frame-steps "
            f"{row['frame_steps_off']} off, {row['frame_steps_on']} on; hits "
            f"{row['hits']}+{row['voice_hits']} voice / misses {row['misses']}; peak cache "
            f"{row['peak_cache_bytes'] / 2**30:.2f} GiB; max rel diff "
            f"{row['max_rel_diff_on_vs_off']:.2e} ({label}); solo eager s {row['solo_eager_s']}",
            flush=True,
        )

    for seconds in a.seconds:
        part1(model, a.dtype, seconds)
    if a.fp32_check and dtype != torch.float32:
        # the exactness bar: fp32 with TF32 off (PyTorch's default for matmuls), first length
        tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        m32 = load_flow(
            a.model_dir, device=a.device, dtype=torch.float32, preset=a.preset, seed=a.seed
        )
        part1(m32, "float32, TF32 off", a.seconds[0])
        del m32
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    if not a.skip_generate:

        def save(row: dict) -> None:
            result["generate_only"].append(row)
            write()

        took: dict[int, float] = {}  # utterance seconds -> duration of its last run
        for seconds in a.seconds:
            for cache_on in (False, True):
                # estimate from the same length, else scale the longest-known run linearly
                known = took.get(seconds) or max(
                    (t * seconds / s for s, t in took.items()), default=0.0
                )
                if time.perf_counter() - started + known > a.budget_s:
                    result["skipped"].append(dict(seconds=seconds, cache=cache_on))
                    print(f"skipped {seconds} s cache {cache_on}: over --budget-s", flush=True)
                    continue
                t0 = time.perf_counter()
                generate_only(model, a, seconds, cache_on, save)
                took[seconds] = time.perf_counter() - t0
    write()
    return result
