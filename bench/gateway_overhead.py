"""What the gateway (and the client) add to a chunk when the models cost nothing.

    python -m bench gateway-overhead --streams 64            # CPU is enough
    python -m bench gateway-overhead --streams 64 --profile out/gw.prof
    python -m bench gateway-overhead --streams 64 --gateways 4  # streams round robin
    python -m bench gateway-overhead --streams 64 --pace 50 --gateway-arg=--block-calls=true

A real gateway process (`python -m gateway`, optionally under cProfile) in front of two
stand-ins in this process that answer at once: a flow service whose mel is zeros of the right
shape, and a vocoder that turns every mel frame into 480 zero samples. N streams open together
(as the closed loop of `python -m bench` does), each with its own inline 3 s voice and all of
its 250 tokens at once (or, with --pace, in bursts of 5 at that many tokens per second, as a
language model sends them). Prints the client-measured first-chunk latency (tokens sent -> first
audio) p50/p95/max, the time until every stream ended and the gateway processes' CPU time per
stream (user + system, all threads, from /proc; Linux only) and the flow calls per stream: on the GPU host the same time sits
in the "gateway" and "wire" stages of the stage attribution, on top of the models. With
--gateways N, N gateway processes share the streams (stream i: gateway i mod N), as replicas
behind a load balancer would; the client and the stand-ins stay one process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import subprocess
import sys
import time

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.stack import free_port
from bench.workload import make_bench_voice
from gateway.client import AsyncClient
from token2wav.tensors import encode
from token2wav.v1 import common_pb2, flow_pb2, flow_pb2_grpc, vocoder_pb2, vocoder_pb2_grpc

LOOKAHEAD = 3
SAMPLES_PER_FRAME = 480


class InstantFlow(flow_pb2_grpc.FlowServicer):
    calls = 0

    async def Generate(self, request, context):
        InstantFlow.calls += 1
        n = request.tokens.shape[0]
        end = n if request.finalize else n - LOOKAHEAD
        frames = 2 * (end - request.token_offset)
        return flow_pb2.GenerateResponse(
            mel=encode(np.zeros((80, frames), np.float32)),
            timing=common_pb2.StageTiming(batch_size=1),
        )


class InstantVocoder(vocoder_pb2_grpc.VocoderServicer):
    async def Session(self, request_iterator, context):
        offset = 0
        async for chunk in request_iterator:
            samples = SAMPLES_PER_FRAME * chunk.mel.shape[1]
            yield vocoder_pb2.VocoderAudio(
                request_id=chunk.request_id,
                seq=chunk.seq,
                sample_offset=offset,
                audio=encode(np.zeros(samples, np.float32)),
                is_final=chunk.finalize,
                timing=common_pb2.StageTiming(batch_size=1),
            )
            offset += samples
            if chunk.finalize:
                return

    async def CancelSession(self, request, context):
        return vocoder_pb2.CancelSessionResponse()


async def stand_in(servicer, add) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    add(servicer, server)
    checker = health.aio.HealthServicer()
    await checker.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads) so far; nan without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return math.nan
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


BURST = 5  # tokens per message when paced


async def one_stream(client: AsyncClient, voice, tokens, pace: float = 0.0) -> tuple[float, float]:
    stream = client.stream(voice, audio_format="pcm16")
    sent = time.perf_counter()

    async def send() -> None:
        if not pace:
            await stream.send(tokens)
        for i in range(0, len(tokens) if pace else 0, BURST):
            await asyncio.sleep(max(0.0, sent + i / pace - time.perf_counter()))
            await stream.send(tokens[i : i + BURST])
        await stream.end()

    sender = asyncio.ensure_future(send())
    first = None
    async for chunk in stream:
        if first is None:
            first = chunk.received_at - sent
    await sender
    return first, time.perf_counter() - sent


async def main_async(a: argparse.Namespace) -> list[dict]:
    flow, flow_port = await stand_in(InstantFlow(), flow_pb2_grpc.add_FlowServicer_to_server)
    voc, voc_port = await stand_in(InstantVocoder(), vocoder_pb2_grpc.add_VocoderServicer_to_server)
    ports = [a.port or free_port()] + [free_port() for _ in range(a.gateways - 1)]
    gws = []
    for i, port in enumerate(ports):
        cmd = [sys.executable]
        if a.profile:  # one file per gateway: PROFILE, PROFILE.1, ...
            cmd += ["-m", "cProfile", "-o", a.profile + (f".{i}" if i else "")]
        cmd += ["-m", "gateway", "--port", str(port), "--metrics-port", "0"]
        cmd += ["--flow-addr", f"127.0.0.1:{flow_port}", "--vocoder-addr", f"127.0.0.1:{voc_port}"]
        cmd += ["--max-streams", str(max(256, 2 * a.streams)), *a.gateway_arg]
        gws.append(subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1")))
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(AsyncClient(f"127.0.0.1:{port}")) for port in ports
            ]
            voices = [make_bench_voice(0, i, 75) for i in range(a.streams)]
            rng = np.random.default_rng(0)
            tokens = rng.integers(0, 6561, (a.streams, a.tokens))
            for client in clients:
                for _ in range(60):  # a gateway is SERVING once its stages answer
                    try:
                        await one_stream(client, voices[0], tokens[0])
                        break
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.5)
            rounds = []
            for rnd in range(a.rounds):
                cpu0 = sum(cpu_seconds(gw.pid) for gw in gws)
                calls0 = InstantFlow.calls
                t0 = time.perf_counter()
                res = await asyncio.gather(
                    *(
                        one_stream(clients[i % len(clients)], voices[i], tokens[i], a.pace)
                        for i in range(a.streams)
                    )
                )
                wall = time.perf_counter() - t0
                cpu_ms = (sum(cpu_seconds(gw.pid) for gw in gws) - cpu0) * 1e3 / a.streams
                calls = (InstantFlow.calls - calls0) / a.streams
                first = sorted(r[0] * 1e3 for r in res)
                p95 = first[min(len(first) - 1, int(0.95 * len(first)))]
                rounds.append(
                    {
                        "first_ms": first,
                        "wall_ms": wall * 1e3,
                        "gateway_cpu_ms": cpu_ms,
                        "flow_calls": calls,
                    }
                )
                print(
                    f"round {rnd}: {a.streams} streams over {len(ports)} gateway(s), first chunk p50 "
                    f"{statistics.median(first):.0f} ms, p95 {p95:.0f} ms, max {first[-1]:.0f} ms; "
                    f"all ended after {wall * 1e3:.0f} ms; gateway CPU {cpu_ms:.1f} ms and "
                    f"{calls:.1f} flow calls per stream",
                    flush=True,
                )
        return rounds
    finally:
        for gw in gws:
            gw.send_signal(2)  # SIGINT: the gateway drains and cProfile writes its file
        for gw in gws:
            gw.wait(timeout=30)
        await flow.stop(None)
        await voc.stop(None)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=250, help="per stream (250 = 10 s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=0, help="the gateway's port (0: a free one)")
    p.add_argument("--gateways", type=int, default=1, help="gateway processes, streams round robin")
    p.add_argument("--profile", default="", help="write the gateway's cProfile stats here")
    p.add_argument("--pace", type=float, default=0.0, help="tokens per second (0: all at once)")
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="an extra flag for the gateways, e.g. --gateway-arg=--block-calls=true (repeatable)",
    )
    a = p.parse_args(argv)
    if a.pace < 0:
        p.error(f"--pace: {a.pace}, want >= 0")
    if a.gateways < 1:
        p.error(f"--gateways: {a.gateways}, want >= 1")
    return asyncio.run(main_async(a))
