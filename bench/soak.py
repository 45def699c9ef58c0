"""A bounded fault-injecting soak of the whole stack on loopback.

    python -m bench soak --duration 180            # CPU, small preset, 3 minutes

Starts flow x2, vocoder x2 and a gateway as subprocesses (bench/stack.py), runs client streams
at 2x the gateway's --max-streams while it injects faults: SIGKILL and SIGTERM of flow and
vocoder replicas (restarted on the same port), clients cancelling mid-stream, bursts of
undecodable bytes at every service. It stops by itself after --duration (or --max-streams-total
streams) and prints a table: streams by outcome and status code, faults by kind, samples lost
and duplicated, streams whose audio differs from the same input's fault-free run, streams that
were admitted before a vocoder kill and still failed, RSS per service per minute.

Exit status 1 when a sample was lost or duplicated, audio differed, an admitted stream failed
across a kill, or any stream ended INTERNAL/UNKNOWN. Loopback only; nothing leaves the host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from bench.stack import Stack, StackConfig
from gateway.client import AsyncClient
from token2wav import SAMPLES_PER_TOKEN
from token2wav.healthcheck import check
from token2wav.tensors import make_voice

FUZZ_METHODS = [
    ("flow_service", "/token2wav.v1.Flow/Generate"),
    ("vocoder_service", "/token2wav.v1.Vocoder/CancelSession"),
    ("gateway", "/token2wav.v1.Gateway/RegisterVoice"),
]
BAD_CODES = {"INTERNAL", "UNKNOWN"}


@dataclass
class Tally:
    outcomes: Counter = field(
        default_factory=Counter
    )  # "OK" / status code name / "CANCELLED_BY_CLIENT"
    faults: Counter = field(default_factory=Counter)  # kind -> count
    samples_lost: int = 0
    samples_duplicated: int = 0
    audio_mismatch: int = 0
    admitted_failed: int = 0  # admitted before a vocoder kill, then failed
    rss: list[dict] = field(default_factory=list)  # per sample: minute, service -> MiB
    references: dict[int, np.ndarray] = field(default_factory=dict)  # input -> fault-free audio
    active: dict[int, bool] = field(default_factory=dict)  # stream -> got its first chunk
    watched: set[int] = field(default_factory=set)  # streams admitted before a vocoder kill


def make_inputs(n: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        n_p = int(rng.integers(8, 30))
        voice = make_voice(
            rng.integers(0, 6561, n_p),
            (rng.standard_normal((2 * n_p, 80)) - 4).astype(np.float32),
            rng.standard_normal(192).astype(np.float32),
        )
        out.append((voice, rng.integers(0, 6561, int(rng.integers(60, 400)))))
    return out


def account(chunks, n_tokens: int, tally: Tally) -> np.ndarray:
    """Samples lost and duplicated from seq/sample_offset bookkeeping; the audio."""
    total = 0
    for c in chunks:
        if c.sample_offset < total:
            tally.samples_duplicated += total - c.sample_offset
        elif c.sample_offset > total:
            tally.samples_lost += c.sample_offset - total
        total = max(total, c.sample_offset + c.samples.size)
    tally.samples_lost += max(0, SAMPLES_PER_TOKEN * n_tokens - total)
    return np.concatenate([c.samples for c in chunks]) if chunks else np.zeros(0, np.float32)


def snr_db(out: np.ndarray, ref: np.ndarray) -> float:
    noise = float(np.sum((out.astype(np.float64) - ref) ** 2))
    return (
        np.inf if noise == 0 else 10 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / noise)
    )


async def one_stream(client, sid: int, inputs, k: int, rng: random.Random, tally: Tally, cancel_p):
    voice, tokens = inputs[k]
    stream = client.stream(voice, audio_format="float32", request_id=f"soak-{sid}")
    cancel_at = rng.randrange(1, 4) if rng.random() < cancel_p else None
    chunks = []
    tally.active[sid] = False

    async def feed():
        i = 0
        while i < len(tokens):
            n = rng.randint(5, 40)
            await stream.send(tokens[i : i + n])
            i += n
            await asyncio.sleep(rng.uniform(0, 0.1))  # an LLM's pace, roughly
        await stream.end()

    feeder = asyncio.ensure_future(feed())
    try:
        async for c in stream:
            tally.active[sid] = True
            chunks.append(c)
            if cancel_at is not None and len(chunks) >= cancel_at:
                stream.cancel()
                tally.faults["client_cancel"] += 1
                tally.outcomes["CANCELLED_BY_CLIENT"] += 1
                return
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
        tally.outcomes[code] += 1
        if sid in tally.watched:
            tally.admitted_failed += 1
            print(f"stream {sid} admitted before a kill failed: {code} {exc.details()}")
        if code == "RESOURCE_EXHAUSTED":
            await asyncio.sleep(rng.uniform(0.1, 0.5))  # a client backs off when refused
        else:
            print(f"stream {sid}: {code}: {exc.details()}")
        return
    except asyncio.CancelledError:
        tally.outcomes["CANCELLED_BY_CLIENT"] += 1
        return
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        tally.active.pop(sid, None)
        tally.watched.discard(sid)
    tally.outcomes["OK"] += 1
    audio = account(chunks, len(tokens), tally)
    ref = tally.references.setdefault(k, audio)
    if ref is not audio and (ref.size != audio.size or snr_db(audio, ref) < 50):
        tally.audio_mismatch += 1


async def clients(target, inputs, args, tally: Tally, stop_at: float, rng: random.Random):
    sid = 0
    budget = args.max_streams_total

    async def worker(w: int):
        nonlocal sid, budget
        async with AsyncClient(target) as client:
            while time.monotonic() < stop_at and budget > 0:
                budget -= 1
                sid += 1
                await one_stream(
                    client, sid, inputs, rng.randrange(len(inputs)), rng, tally, args.cancel_p
                )

    await asyncio.gather(*[worker(w) for w in range(2 * args.max_streams)])


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def wait_serving(stack: Stack, name: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    addr = f"127.0.0.1:{stack.ports[name]}"
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check, addr, "", 1.0):
            return
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{name} did not come back within {timeout:.0f} s")


async def fault(stack: Stack, kind: str, tally: Tally, rng: random.Random) -> None:
    if kind == "fuzz":
        for _ in range(20):
            module, method = rng.choice(FUZZ_METHODS)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports[module]}") as ch:
                try:
                    await ch.unary_unary(method)(rng.randbytes(rng.randint(1, 200)), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    if exc.code().name in BAD_CODES:
                        tally.outcomes[f"fuzz_{exc.code().name}"] += 1
        tally.faults["fuzz_burst"] += 1
        return
    how, module = kind.split("_", 1)  # kill_vocoder, term_flow, ...
    names = [n for n in stack.procs if n.split(".")[0] == f"{module}_service"]
    name = rng.choice(names)
    proc = stack.procs[name]
    if module == "vocoder":
        tally.watched.update(s for s, admitted in tally.active.items() if admitted)
    proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGTERM)
    await asyncio.to_thread(proc.wait, 60)
    tally.faults[kind] += 1
    await asyncio.sleep(rng.uniform(0.5, 2.0))  # down for a moment
    stack.spawn(name, restart=True)
    await wait_serving(stack, name)


async def faults(stack, args, tally: Tally, stop_at: float, rng: random.Random):
    kinds = ["kill_vocoder", "term_vocoder", "kill_flow", "term_flow", "fuzz"]
    n = 0
    while time.monotonic() + args.fault_interval < stop_at:
        await asyncio.sleep(args.fault_interval)
        if n % len(kinds) == 0:
            rng.shuffle(kinds)  # every kind once per round, in a random order
        await fault(stack, kinds[n % len(kinds)], tally, rng)
        n += 1


async def rss_sampler(stack: Stack, tally: Tally, stop_at: float, t0: float):
    while True:
        tally.rss.append(
            {"minute": round((time.monotonic() - t0) / 60, 1)}
            | {name: round(rss_mib(p.pid), 1) for name, p in stack.procs.items()}
        )
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(min(60.0, max(0.0, stop_at - time.monotonic())))


def table(tally: Tally, elapsed: float) -> str:
    streams = sum(tally.outcomes[k] for k in tally.outcomes if not k.startswith("fuzz_"))
    lines = [
        f"soak: {elapsed:.0f} s, {streams} streams",
        "",
        "| what | count |",
        "|---|---|",
    ]
    lines += [f"| streams ended {k} | {v} |" for k, v in sorted(tally.outcomes.items())]
    lines += [f"| fault {k} | {v} |" for k, v in sorted(tally.faults.items())]
    lines += [
        f"| samples lost | {tally.samples_lost} |",
        f"| samples duplicated | {tally.samples_duplicated} |",
        f"| audio differs from the fault-free run | {tally.audio_mismatch} |",
        f"| admitted before a vocoder kill, then failed | {tally.admitted_failed} |",
        "",
    ]
    names = [k for k in tally.rss[0] if k != "minute"] if tally.rss else []
    lines += ["| minute | " + " | ".join(f"{n} RSS MiB" for n in names) + " |"]
    lines += ["|---" * (len(names) + 1) + "|"]
    lines += [
        f"| {r['minute']} | " + " | ".join(str(r.get(n, "")) for n in names) + " |"
        for r in tally.rss
    ]
    return "\n".join(lines)


def failed(tally: Tally) -> bool:
    bad = sum(v for k, v in tally.outcomes.items() if k.removeprefix("fuzz_") in BAD_CODES)
    return bool(
        tally.samples_lost
        or tally.samples_duplicated
        or tally.audio_mismatch
        or tally.admitted_failed
        or bad
    )


async def soak(args) -> int:
    rng = random.Random(args.seed)
    inputs = make_inputs(args.num_inputs, args.seed)
    config = StackConfig(
        flow_replicas=2,
        vocoder_replicas=2,
        threads=1,
        flow_args=("--max-wait-ms", "2", "--grace-period", "3"),
        vocoder_args=("--grace-period", "3"),
        gateway_args=(
            "--max-streams",
            str(args.max_streams),
            "--health-check-interval",
            "0.5",
            "--vocoder-failovers",
            "5",
        ),
    )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="t2w-soak-"))
    stack = Stack(config, log_dir, name="soak")
    tally = Tally()
    with stack:
        stack.start()
        await asyncio.to_thread(stack.wait_ready)
        t0 = time.monotonic()
        stop_at = t0 + args.duration
        await asyncio.gather(
            clients(stack.target, inputs, args, tally, stop_at, rng),
            faults(stack, args, tally, stop_at, rng),
            rss_sampler(stack, tally, stop_at, t0),
        )
        elapsed = time.monotonic() - t0
    print(table(tally, elapsed))
    print(f"\nservice logs: {log_dir}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "seconds": elapsed,
                    "outcomes": dict(tally.outcomes),
                    "faults": dict(tally.faults),
                    "samples_lost": tally.samples_lost,
                    "samples_duplicated": tally.samples_duplicated,
                    "audio_mismatch": tally.audio_mismatch,
                    "admitted_failed": tally.admitted_failed,
                    "rss_mib": tally.rss,
                },
                indent=1,
            )
        )
    return 1 if failed(tally) else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load (it stops)")
    p.add_argument("--max-streams", type=int, default=4, help="gateway --max-streams; clients 2x")
    p.add_argument("--max-streams-total", type=int, default=100_000, help="stop after this many")
    p.add_argument("--fault-interval", type=float, default=8.0, help="seconds between faults")
    p.add_argument("--cancel-p", type=float, default=0.1, help="share of clients that cancel")
    p.add_argument("--num-inputs", type=int, default=6, help="distinct voice+token inputs")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--log-dir", default="", help="service logs (default: a temp dir)")
    p.add_argument("--json", default="", help="also write the figures here")
    return p


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(soak(build_parser().parse_args(argv)))
