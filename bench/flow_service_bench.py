"""flow_service alone under load: N concurrent streams calling `Generate` over gRPC (in-process
server on loopback), each replaying the gateway's chunk schedule for a 3 s prompt and a 10 s
utterance (75 + 250 tokens: chunks of 200, 300, 500 and 650 DiT frames), batching on and then
off (`--max-batch-size 1`, the same code path) in the same run.

    python -m bench flow-service --device cuda --dtype bfloat16
    python -m bench flow-service --smoke      # small preset, CPU, seconds

Like the gateway with all tokens in hand, each stream keeps up to --max-inflight of its chunk
calls in flight, and starts its next utterance when the last call of the previous one is back
(closed loop: the figures are the service's capacity). Reported per level: frame-steps per
second (real DiT frames x solver steps, the unit the issue's DiT ceiling is quoted in), audio
seconds per second, client-side per-call latency percentiles, and the service's own timing
(queue wait, batch compute, batch size). Random weights unless --model-dir: speed only.
Writes OUT/flow_service_bench.json after every level.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from bench import parts
from bench.workload import TOKEN_RATE, make_bench_voice, make_tokens
from flow_service.config import FlowConfig
from flow_service.config import build_parser as flow_parser
from flow_service.model import NUM_STEPS, load_flow
from flow_service.service import FlowService
from gateway.downstream import FlowClient
from gateway.routing import ReplicaSet
from gateway.schedule import ChunkPlanner
from token2wav.service import start


def plan_calls(num_prompt_tokens: int, num_tokens: int) -> list:
    """The gateway's chunk calls for one utterance whose tokens all arrived at once."""
    planner = ChunkPlanner(num_prompt_tokens)
    calls = []
    for ended in (False, True):
        while (chunk := planner.next_call(num_tokens, ended)) is not None:
            calls.append(chunk)
    return calls


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 2) if values else None


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


async def run_level(client: FlowClient, a: argparse.Namespace, streams: int, tag: str) -> dict:
    calls: list[dict] = []

    errors: dict[str, int] = {}  # status code -> failed calls (the level goes on)
    completed: list[bool] = []  # per utterance: every call answered

    async def one_call(rid, seq, voice, tokens, chunk, gate) -> bool:
        async with gate:
            t0 = time.perf_counter()
            try:
                out = await client.generate(
                    request_id=rid,
                    seq=seq,
                    voice=voice,
                    tokens=tokens[: chunk.num_tokens],
                    token_offset=chunk.token_offset,
                    finalize=chunk.finalize,
                    streaming=chunk.streaming,
                    timeout=a.call_timeout,
                )
            except Exception as exc:  # noqa: BLE001 - counted by code, reported per level
                code = getattr(exc, "code", None)
                code = code() if callable(code) else code  # AioRpcError vs ServiceError
                name = code.name if code is not None else type(exc).__name__
                errors[name] = errors.get(name, 0) + 1
                return False
            latency_ms = (time.perf_counter() - t0) * 1e3
        calls.append(
            dict(
                latency_ms=latency_ms,
                queue_ms=out.queue_ms,
                compute_ms=out.compute_ms,
                batch_size=out.batch_size,
                frames=chunk.num_seq_frames(a.prompt_tokens),
                out_frames=out.num_frames,
                first=chunk.seq == 0,
            )
        )
        return True

    async def stream(i: int) -> None:
        voice = make_bench_voice(a.seed, i, a.prompt_tokens)
        gate = asyncio.Semaphore(a.max_inflight)
        for k in range(a.utterances):
            tokens = make_tokens(a.seed, i * a.utterances + k, a.utterance_tokens)
            rid = f"{tag}-s{i}-u{k}"
            chunks = plan_calls(a.prompt_tokens, len(tokens))
            ok = await asyncio.gather(
                *(one_call(rid, c.seq, voice, tokens, c, gate) for c in chunks)
            )
            completed.append(all(ok))

    t0 = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(streams)))
    wall = time.perf_counter() - t0
    utterances = streams * a.utterances
    done = sum(completed)  # only whole utterances count as audio
    lat = [c["latency_ms"] for c in calls]
    first = [c["latency_ms"] for c in calls if c["first"]]
    return dict(
        streams=streams,
        utterances=utterances,
        calls=len(calls),
        errors=errors,
        wall_s=round(wall, 3),
        frame_steps_per_s=round(sum(c["frames"] for c in calls) * NUM_STEPS / wall, 1),
        utterances_completed=done,
        audio_s_per_s=round(done * a.utterance_tokens / TOKEN_RATE / wall, 3),
        mel_frames_out=sum(c["out_frames"] for c in calls),
        latency_ms={q: pct(lat, q) for q in (50, 95, 99)},
        first_chunk_latency_ms={q: pct(first, q) for q in (50, 95, 99)},
        queue_ms_mean=_mean([c["queue_ms"] for c in calls]),
        compute_ms_mean=_mean([c["compute_ms"] for c in calls]),
        batch_size_mean=_mean([c["batch_size"] for c in calls]),
    )


def cache_stats(engine) -> dict | None:
    cache = engine.prefix_cache
    return None if cache is None else dict(cache.stats)


def cache_level(engine, before: dict) -> dict:
    """The prefix cache's counters over one level, its hit rate and bytes at the end."""
    cache = engine.prefix_cache
    d = {k: v - before[k] for k, v in cache.stats.items()}
    lookups = d["hits"] + d["voice_hits"] + d["misses"]
    frames = d["reused_frames"] + d["computed_frames"]
    return dict(
        d,
        hit_rate=round((d["hits"] + d["voice_hits"]) / lookups, 3) if lookups else None,
        reused_frame_share=round(d["reused_frames"] / frames, 3) if frames else None,
        bytes=cache.bytes_used,
        entries=cache.num_entries,
    )


async def run_mode(model, a: argparse.Namespace, batching: bool, save) -> list[dict]:
    flags = ["--port", "0", "--metrics-port", "0", "--host", "127.0.0.1"]
    flags += ["--device", a.device, "--dtype", a.dtype]
    flags += a.flow_arg
    if not batching:
        flags += ["--max-batch-size", "1"]  # after the pass-through flags: they cannot undo it
    config = FlowConfig.from_args(flow_parser().parse_args(flags))
    server = await start(FlowService(config, model=model))  # warmed up, as in production
    engine = server.service.engine
    replicas = ReplicaSet(f"127.0.0.1:{server.port}")
    client = FlowClient(replicas)
    label = "on" if batching else "off"
    rows = []
    try:
        await run_level(client, a, min(4, max(a.concurrency)), f"warm-{label}")  # not measured
        for n in a.concurrency:
            before = cache_stats(engine)
            row = dict(batching=label, **await run_level(client, a, n, f"{label}-c{n}"))
            if before is not None:
                row["prefix_cache"] = cache_level(engine, before)
            rows.append(row)
            save(row)  # after every level: a crash or a time limit keeps what was measured
            print(
                f"batching {label:3} {n:3} streams: {row['frame_steps_per_s']:>10.0f} "
                f"frame-steps/s {row['audio_s_per_s']:8.2f} audio s/s  latency p50/p95 "
                f"{row['latency_ms'][50]}/{row['latency_ms'][95]} ms  batch "
                f"{row['batch_size_mean']}  errors {row['errors'] or 0}",
                flush=True,
            )
    finally:
        await replicas.close()
        await server.drain()  # stops the engine too
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = parts.parser(
        "flow-service",
        __doc__,
        smoke={
            "dtype": ["float32"],
            "concurrency": "1,3",
            "utterances": 1,
            "utterance_tokens": 60,
        },
    )
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated stream counts")
    p.add_argument("--utterances", type=int, default=2, help="per stream and level")
    p.add_argument("--prompt-tokens", type=int, default=75)
    p.add_argument("--utterance-tokens", type=int, default=250)
    p.add_argument("--max-inflight", type=int, default=4, help="calls in flight per stream")
    p.add_argument("--batching", default="on,off", help="on, off or on,off")
    p.add_argument("--call-timeout", type=float, default=600.0)
    p.add_argument(
        "--flow-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flow_service flag, repeatable (e.g. --flow-arg=--max-wait-ms=0)",
    )
    a = parts.parse(p, argv)
    a.dtype = parts.one_dtype(p, a)
    a.concurrency = [int(x) for x in str(a.concurrency).split(",")]
    a.batching = [x.strip() for x in a.batching.split(",") if x.strip()]
    if not set(a.batching) <= {"on", "off"} or not a.batching:
        p.error("--batching: on, off or on,off")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    parts.cpu_threads(a.device)
    model = load_flow(
        a.model_dir, device=a.device, dtype=parts.DTYPES[a.dtype], preset=a.preset, seed=a.seed
    )
    result = parts.record(a, rows=[], on_off_ratio={})

    def save(row: dict) -> None:
        result["rows"].append(row)
        for n in a.concurrency:
            by = {r["batching"]: r for r in result["rows"] if r["streams"] == n}
            if {"on", "off"} <= set(by) and by["off"]["frame_steps_per_s"] > 0:
                ratio = by["on"]["frame_steps_per_s"] / by["off"]["frame_steps_per_s"]
                result["on_off_ratio"][n] = round(ratio, 2)
        parts.save(a, result, "flow_service_bench")

    for label in a.batching:
        asyncio.run(run_mode(model, a, label == "on", save))
    print("on/off frame-steps ratio by streams:", result["on_off_ratio"], flush=True)
    return result
