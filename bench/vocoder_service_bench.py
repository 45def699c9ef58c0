"""vocoder_service benchmark: N concurrent sessions over gRPC (in-process server on loopback),
each replaying the upstream chunk schedule for a 10 s utterance (500 mel frames in chunks of
50, 100, 200, then the rest with finalize; docs/REFERENCE.md §6.2/§6.4), batching across sessions on and off
in the same run; plus per-chunk model time against history length, and upstream's algorithm
(re-decode the whole mel history every chunk, docs/REFERENCE.md §6.3) on the same card as the reference.

    python -m bench vocoder-service --device cuda --preset cosyvoice3-0.5b
    python -m bench vocoder-service --smoke     # tiny CPU config

Each session is closed-loop: it sends chunk k+1 when chunk k's audio is back, so the figures
are the service's capacity, not a flow-paced stream. Latency is client-side, send -> audio.
Random weights unless --model-dir: the numbers measure speed, not speech. Writes
OUT/vocoder_service_bench.json.
"""

from __future__ import annotations

import asyncio
import platform
import sys
import time

import grpc
import numpy as np
import torch

from bench import parts
from bench.vocoder_model import make_mel, upstream_schedule
from token2wav import SAMPLES_PER_FRAME
from token2wav.server import ServerOptions
from token2wav.service import start as start_service
from token2wav.tensors import decode, encode
from token2wav.v1 import vocoder_pb2, vocoder_pb2_grpc
from vocoder_service.config import BatcherConfig, ModelConfig, SessionConfig, VocoderServiceConfig
from vocoder_service.model import SAMPLE_RATE, load_hift
from vocoder_service.service import VocoderService


def pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


# -- over gRPC -----------------------------------------------------------------------------------


async def one_session(stub, rid: str, mel: np.ndarray, sizes: list[int]):
    call = stub.Session(timeout=600)
    latencies, timings, offset, samples = [], [], 0, 0
    for seq, n in enumerate(sizes):
        msg = vocoder_pb2.VocoderChunk(
            request_id=rid,
            seq=seq,
            mel=encode(mel[:, offset : offset + n]),
            finalize=seq == len(sizes) - 1,
        )
        start = time.perf_counter()
        await call.write(msg)
        answer = await call.read()
        latencies.append(time.perf_counter() - start)
        if answer.sample_offset != samples:
            raise RuntimeError(f"{rid} seq {seq}: offset {answer.sample_offset} != {samples}")
        samples += decode(answer.audio, "audio", shape=(None,)).shape[0]
        timings.append((answer.timing.queue_ms, answer.timing.compute_ms, answer.timing.batch_size))
        offset += n
    await call.done_writing()
    if samples != mel.shape[1] * SAMPLES_PER_FRAME:
        raise RuntimeError(f"{rid}: {samples} samples for {mel.shape[1]} frames")
    return latencies, timings, samples


async def load_sweep(model, args, batching: bool) -> list[dict]:
    cfg = VocoderServiceConfig(
        model=ModelConfig(
            preset=args.preset, model_dir=args.model_dir, device=args.device, dtype=args.dtype
        ),
        sessions=SessionConfig(max_num_sessions=max(256, 2 * max(args.sessions))),
        batcher=BatcherConfig(
            max_batch_sessions=args.max_batch_sessions if batching else 1,
            max_wait_ms=args.max_wait_ms,
        ),
        server=ServerOptions(port=0, grace_period=5),
    )
    server = await start_service(VocoderService(cfg, model=model))
    port = server.port
    rows = []
    sizes = upstream_schedule(args.frames)
    mels = [make_mel(args.frames, i).numpy() for i in range(max(args.sessions))]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = vocoder_pb2_grpc.VocoderStub(ch)
            # Warm-up round (allocator, kernel selection for these shapes); not measured.
            await asyncio.gather(
                *(one_session(stub, f"warm-{i}", mels[i], sizes) for i in range(min(4, len(mels))))
            )
            for n in args.sessions:
                if args.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                parts.sync(args.device)
                start = time.perf_counter()
                results = await asyncio.gather(
                    *(
                        one_session(stub, f"b{int(batching)}-n{n}-{i}", mels[i], sizes)
                        for i in range(n)
                    )
                )
                wall = time.perf_counter() - start
                lat = [x for r in results for x in r[0]]
                first = [r[0][0] for r in results]
                tim = [t for r in results for t in r[1]]
                audio_s = sum(r[2] for r in results) / SAMPLE_RATE
                rows.append(
                    {
                        "batching": batching,
                        "sessions": n,
                        "wall_s": wall,
                        "audio_s": audio_s,
                        "xrt": audio_s / wall,
                        "chunk_ms_p50": 1e3 * pct(lat, 50),
                        "chunk_ms_p95": 1e3 * pct(lat, 95),
                        "chunk_ms_p99": 1e3 * pct(lat, 99),
                        "first_chunk_ms_p50": 1e3 * pct(first, 50),
                        "first_chunk_ms_p95": 1e3 * pct(first, 95),
                        "queue_ms_p50": pct([t[0] for t in tim], 50),
                        "step_ms_p50": pct([t[1] for t in tim], 50),
                        "mean_batch": float(np.mean([t[2] for t in tim])),
                        "peak_gpu_mib": (
                            torch.cuda.max_memory_allocated() / 2**20
                            if args.device.startswith("cuda")
                            else 0.0
                        ),
                    }
                )
                print(
                    f"  batching={'on ' if batching else 'off'} sessions={n:3d} "
                    f"xRT={rows[-1]['xrt']:8.1f} chunk p50={rows[-1]['chunk_ms_p50']:7.1f} ms",
                    flush=True,
                )
    finally:
        await server.drain()
    return rows


# -- in-process: history length and the upstream reference ---------------------------------------


def upstream_redecode(model, mel: torch.Tensor, sizes: list[int], device: str):
    """Upstream's loop (docs/REFERENCE.md §6.3): decode all mel so far every chunk, keep the new samples."""
    emitted, total_ms, pieces, ends = 0, 0.0, [], np.cumsum(sizes)
    for k, end in enumerate(ends):
        out, ms = parts.once(
            lambda e=end, k=k: model.decode(mel[:, :e], k == len(sizes) - 1), device
        )
        pieces.append(out[emitted:])
        emitted = out.shape[0]
        total_ms += ms
    return torch.cat(pieces), total_ms


def incremental(model, mel: torch.Tensor, sizes: list[int], device: str):
    st, pieces, per_chunk, offset = model.new_session(), [], [], 0
    for k, n in enumerate(sizes):
        chunk = mel[:, offset : offset + n]
        (out,), ms = parts.once(
            lambda c=chunk, k=k: model.decode_batch([st], [c], [k == len(sizes) - 1]), device
        )
        pieces.append(out)
        per_chunk.append((offset, ms))  # (history frames before the chunk, ms)
        offset += n
    return torch.cat(pieces), per_chunk


def model_only(model, args) -> list[dict]:
    """The same N-session schedule straight on model.step: lockstep batched vs one by one."""
    dev, sizes, rows = args.device, upstream_schedule(args.frames), []
    mels = [make_mel(args.frames, 100 + i) for i in range(max(args.sessions))]
    edges = np.cumsum([0, *sizes])
    for n in sorted({x for x in args.sessions if x in (1, 8, 64)} | {max(args.sessions)}):
        states = [model.new_session() for _ in range(n)]
        batched = 0.0
        for k in range(len(sizes)):
            chunk = [m[:, edges[k] : edges[k + 1]] for m in mels[:n]]
            last = [k == len(sizes) - 1] * n
            batched += parts.once(
                lambda s=states, c=chunk, f=last: model.decode_batch(s, c, f), dev
            )[1]
        serial = 0.0
        for m in mels[:n]:
            serial += sum(ms for _, ms in incremental(model, m, sizes, dev)[1])
        audio_s = n * args.frames / 50
        rows.append(
            {
                "sessions": n,
                "batched_ms": batched,
                "serial_ms": serial,
                "batched_xrt": audio_s / (batched / 1e3),
                "serial_xrt": audio_s / (serial / 1e3),
            }
        )
        print(
            f"  model only, sessions={n:3d}: batched {batched:8.1f} ms, serial {serial:8.1f} ms",
            flush=True,
        )
    return rows


def history_and_reference(model, args) -> dict:
    dev = args.device
    utt = make_mel(args.frames, 7).to(dev)
    sizes = upstream_schedule(args.frames)
    for _ in range(args.warmup):
        incremental(model, utt, sizes, dev)
        upstream_redecode(model, utt, sizes, dev)
    up = [upstream_redecode(model, utt, sizes, dev) for _ in range(args.repeats)]
    inc = [incremental(model, utt, sizes, dev) for _ in range(args.repeats)]
    up_ms = float(np.median([u[1] for u in up]))
    inc_ms = float(np.median([sum(ms for _, ms in i[1]) for i in inc]))
    err = float((inc[0][0] - up[0][0]).abs().max())
    # Per-chunk time against history: one long session in equal chunks.
    long_mel = make_mel(args.long_frames, 8).to(dev)
    long_sizes = [args.long_chunk] * (args.long_frames // args.long_chunk)
    for _ in range(args.warmup):
        incremental(model, long_mel[:, : 4 * args.long_chunk], long_sizes[:4], dev)
    runs = [incremental(model, long_mel, long_sizes, dev) for _ in range(args.repeats)]
    per_chunk = np.median([[ms for _, ms in r[1]] for r in runs], axis=0)
    hist = [off for off, _ in runs[0][1]]
    full, _ = parts.once(lambda: model.decode(long_mel, True), dev)
    long_err = float((runs[0][0] - full).abs().max())
    points = sorted({min(args.long_frames, p) for p in (500, 1000, 2000, args.long_frames)})
    redecode = {
        p: parts.once(lambda p=p: model.decode(long_mel[:, :p], False), dev)[1] for p in points
    }
    return {
        "utterance_frames": args.frames,
        "schedule": sizes,
        "upstream_redecode_total_ms": up_ms,
        "upstream_redecode_xrt": args.frames / 50 / (up_ms / 1e3),
        "incremental_total_ms": inc_ms,
        "incremental_xrt": args.frames / 50 / (inc_ms / 1e3),
        "incremental_vs_upstream_max_abs": err,
        "long_frames": args.long_frames,
        "long_chunk": args.long_chunk,
        "per_chunk_ms_by_history": [[int(h), float(m)] for h, m in zip(hist, per_chunk)],
        "long_stitched_vs_full_decode_max_abs": long_err,
        "full_redecode_ms_by_history": {str(p): ms for p, ms in redecode.items()},
    }


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = parts.parser(
        "vocoder-service",
        __doc__,
        dtype="float32",
        device="cuda" if torch.cuda.is_available() else "cpu",
        repeats=3,
        smoke={"sessions": "1,2", "frames": 120, "long_frames": 300, "long_chunk": 50},
    )
    p.add_argument("--sessions", default="1,2,4,8,16,32,64", help="comma-separated sweep")
    p.add_argument("--frames", type=int, default=500, help="utterance length (500 = 10 s)")
    p.add_argument("--long-frames", type=int, default=3000, help="history test length (60 s)")
    p.add_argument("--long-chunk", type=int, default=100)
    p.add_argument("--max-batch-sessions", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--disable-tf32", action="store_true", help="cuDNN/cuBLAS fp32 without TF32")
    args = parts.parse(p, argv)
    args.dtype = parts.one_dtype(p, args)
    args.sessions = [int(x) for x in args.sessions.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.disable_tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    start = time.perf_counter()
    model = load_hift(
        args.model_dir,
        device=args.device,
        dtype=parts.DTYPES[args.dtype],
        preset=args.preset,
        seed=args.seed,
    )
    env = {
        "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "preset": args.preset,
        "dtype": args.dtype,
        "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
    }
    print(f"# {env}", flush=True)
    ref = history_and_reference(model, args)
    print("# history / reference done", flush=True)
    direct = model_only(model, args)
    rows = []
    for batching in (True, False):
        rows += asyncio.run(load_sweep(model, args, batching))
    report = {
        "env": env,
        "reference": ref,
        "model_only": direct,
        "load": rows,
        "total_s": time.perf_counter() - start,
    }

    print(
        f"\nvocoder_service, {args.preset} {args.dtype} on {env['device']}, "
        f"{args.frames}-frame utterances, schedule {ref['schedule']}"
    )
    print(
        f"{'batch':>5} {'sess':>4} {'xRT':>8} {'chunk p50':>9} {'p95':>7} {'p99':>7} "
        f"{'first p50':>9} {'step p50':>8} {'mean b':>6} {'GPU MiB':>8}"
    )
    for r in rows:
        print(
            f"{'on' if r['batching'] else 'off':>5} {r['sessions']:4d} {r['xrt']:8.1f} "
            f"{r['chunk_ms_p50']:9.1f} {r['chunk_ms_p95']:7.1f} {r['chunk_ms_p99']:7.1f} "
            f"{r['first_chunk_ms_p50']:9.1f} {r['step_ms_p50']:8.1f} {r['mean_batch']:6.1f} "
            f"{r['peak_gpu_mib']:8.0f}"
        )
    print("\nmodel only (no gRPC), all sessions' schedules, batched lockstep vs one by one:")
    for r in direct:
        print(
            f"  sessions {r['sessions']:3d}: batched xRT {r['batched_xrt']:8.1f}, "
            f"serial xRT {r['serial_xrt']:8.1f}, speed-up {r['serial_ms'] / r['batched_ms']:5.2f}x"
        )
    print(f"\nreference, one {args.frames / 50:g} s utterance, same card, model time only:")
    print(
        f"  upstream algorithm (full re-decode per chunk): {ref['upstream_redecode_total_ms']:8.1f} ms"
        f"  xRT {ref['upstream_redecode_xrt']:7.1f}"
    )
    print(
        f"  incremental session (this service's step):     {ref['incremental_total_ms']:8.1f} ms"
        f"  xRT {ref['incremental_xrt']:7.1f}   max |diff| {ref['incremental_vs_upstream_max_abs']:.2e}"
    )
    print(
        f"\nper-chunk time vs history ({args.long_chunk}-frame chunks, {args.long_frames} frames):"
    )
    hist = ref["per_chunk_ms_by_history"]
    shown = hist[:: max(1, len(hist) // 8)]
    for h, ms in shown + ([hist[-1]] if hist[-1] is not shown[-1] else []):
        print(f"  history {h:5d} frames: incremental {ms:7.2f} ms")
    for p, ms in ref["full_redecode_ms_by_history"].items():
        print(f"  full re-decode of {p:>5} frames: {ms:8.2f} ms")
    print(
        f"  stitched vs full decode, {args.long_frames} frames: max |diff| "
        f"{ref['long_stitched_vs_full_decode_max_abs']:.2e}"
    )
    print(f"total {report['total_s']:.1f} s")
    parts.save(args, report, "vocoder_service_bench")
    return 0
