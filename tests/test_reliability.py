"""Reliability on loopback (small presets, CPU): honest status codes, cancellation hygiene,
vocoder failover. Stacks come from tests/_stack.py."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import warnings

import grpc
import numpy as np
import pytest
import torch
from _stack import start_stack, stream_inputs, until

from flow_service import metrics as flow_metrics
from flow_service.model import load_flow
from gateway.client import AsyncClient, honest_error
from gateway.downstream import downstream_error
from token2wav import SAMPLES_PER_TOKEN
from token2wav.errors import DETAILS_KEY, STATUS_KEY, scrub
from vocoder_service.model import load_hift

torch.set_num_threads(1)
RE = grpc.StatusCode.RESOURCE_EXHAUSTED
IA = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def models():
    return load_flow(None, preset="small"), load_hift(None, preset="small")


async def collect(client, voice, tokens, pieces=4, pause=0.0, **kw):
    """Send the tokens in `pieces` writes (`pause` s apart, like an LLM) then EndOfInput; the
    chunks, or the error."""
    stream = client.stream(voice, audio_format="float32", **kw)
    for part in np.array_split(tokens, pieces):
        await stream.send(part)
        if pause:
            await asyncio.sleep(pause)
    await stream.end()
    try:
        return [c async for c in stream]
    except grpc.aio.AioRpcError as exc:
        return exc


def audio(chunks) -> np.ndarray:
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    offset = 0
    for c in chunks:
        assert c.sample_offset == offset
        offset += c.samples.size
    assert chunks[-1].is_final
    return np.concatenate([c.samples for c in chunks])


# -- honest codes ----------------------------------------------------------------------------


async def test_every_refusal_is_resource_exhausted(models):
    """40 grpc.aio clients against --max-streams 8, each writing while the gateway refuses it:
    every refusal reaches the client as RESOURCE_EXHAUSTED, never `Internal error from Core`."""
    stack = await start_stack(models, "--max-streams", "8")
    try:
        voice, tokens = stream_inputs(1, 10, 30)
        async with AsyncClient(stack.target) as client:
            results = await asyncio.gather(
                *[collect(client, voice, tokens, pieces=30, pause=0.005) for _ in range(40)]
            )
        errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        ok = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
        assert errors, "no stream was refused: the test did not overload the gateway"
        assert len(ok) >= 8
        assert {(e.code(), e.details()) for e in errors} == {
            (RE, "gateway at its limit of 8 streams")
        }
        for chunks in ok:
            assert audio(chunks).size == SAMPLES_PER_TOKEN * len(tokens)
    finally:
        await stack.stop()


def test_client_maps_core_write_error_back():
    """When grpc.aio still loses the race, the client library recovers the status that the
    gateway repeated in its headers; without them it says ABORTED (retry), not INTERNAL."""
    md = grpc.aio.Metadata((STATUS_KEY, "RESOURCE_EXHAUSTED"), (DETAILS_KEY, "full"))
    raced = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, md, grpc.aio.Metadata(), "Internal error from Core"
    )
    mapped = honest_error(raced)
    assert (mapped.code(), mapped.details()) == (RE, "full")
    bare = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        "Internal error from Core",
    )
    assert honest_error(bare).code() == grpc.StatusCode.ABORTED
    real = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, md, grpc.aio.Metadata(), "internal error (logged on the server)"
    )
    assert honest_error(real) is real


def test_no_internal_address_reaches_the_client():
    assert scrub("vocoder 127.0.0.1:57053: gone") == "vocoder <replica>: gone"
    assert scrub("ipv6:[::1]:50053 refused") == "<replica> refused"
    assert scrub("vocoder-0.vocoder.ns.svc:50053 down") == "<replica> down"
    assert scrub("tokens.tokens[2]: id 6561 outside 0..6560") == (
        "tokens.tokens[2]: id 6561 outside 0..6560"
    )
    exc = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        "failed to connect to all addresses; last error: ipv4:10.1.2.3:50053: refused",
    )
    err = downstream_error(exc, "vocoder")
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "10.1.2.3" not in err.message and "50053" not in err.message


RAW_METHODS = [
    ("/token2wav.v1.Flow/Generate", "unary"),
    ("/token2wav.v1.Vocoder/CancelSession", "unary"),
    ("/token2wav.v1.Vocoder/Session", "stream"),
    ("/token2wav.v1.Gateway/RegisterVoice", "unary"),
    ("/token2wav.v1.Gateway/Synthesize", "stream"),
]
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f\x01"  # field 1, length-delimited, length past the end


async def test_undecodable_bytes_are_invalid_argument(models, caplog):
    """Bytes that do not parse get INVALID_ARGUMENT on all three services, one log line each,
    no traceback; the services keep serving."""
    stack = await start_stack(models)
    ports = {
        "Flow": stack.flow_server.port,
        "Vocoder": stack.vocoder_ports[0],
        "Gateway": stack.gateway_server.port,
    }
    caplog.set_level(logging.INFO)
    try:
        for method, kind in RAW_METHODS:
            service = method.split(".")[-1].split("/")[0]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[service]}") as ch:
                caplog.clear()
                if kind == "unary":
                    call = ch.unary_unary(method)(GARBAGE, timeout=10)
                else:
                    call = ch.stream_stream(method)(iter([GARBAGE]), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    if kind == "unary":
                        await call
                    else:
                        async for _ in call:
                            pass
                exc = honest_error(info.value)
                assert exc.code() == IA, (method, exc.code(), exc.details())
                assert exc.details().startswith("message: not a valid"), exc.details()
                lines = [r for r in caplog.records if "not a valid" in r.getMessage()]
                assert len(lines) == 1, (method, [r.getMessage() for r in caplog.records])
                assert not any(r.exc_info for r in caplog.records), method
        voice, tokens = stream_inputs(2, 10, 30)
        async with AsyncClient(stack.target) as client:
            assert audio(await collect(client, voice, tokens)).size == 30 * SAMPLES_PER_TOKEN
    finally:
        await stack.stop()


async def test_request_id_with_a_newline_is_refused_by_flow(models):
    from token2wav.tensors import encode
    from token2wav.v1 import flow_pb2, flow_pb2_grpc

    stack = await start_stack(models)
    try:
        voice, tokens = stream_inputs(3, 10, 30)
        req = flow_pb2.GenerateRequest(
            request_id="abc\nFAKE LOG LINE", tokens=encode(tokens.astype(np.int32))
        )
        req.inline_voice.CopyFrom(voice.to_proto())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.flow_server.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await flow_pb2_grpc.FlowStub(ch).Generate(req, timeout=10)
        assert info.value.code() == IA and info.value.details().startswith("request_id:")
    finally:
        await stack.stop()


async def test_taken_port_fails_at_start_naming_it(models):
    from token2wav.errors import StartupError
    from token2wav.server import GrpcServer, ServerOptions
    from token2wav.service import Service

    first = GrpcServer(ServerOptions(port=0), Service(None))
    port = await first.start()
    try:
        second = GrpcServer(ServerOptions(port=port), Service(None))
        with pytest.raises(StartupError, match=f"127.0.0.1:{port}"):
            await second.start()
    finally:
        await first.drain()


async def test_idle_streams_are_closed(models):
    """Config and then nothing, or tokens and then no EndOfInput: the stream ends with
    DEADLINE_EXCEEDED after the configured idle time instead of holding its slot."""
    stack = await start_stack(
        models, "--max-streams", "2", "--first-tokens-timeout", "0.3", "--input-idle-timeout", "0.3"
    )
    try:
        voice, tokens = stream_inputs(4, 10, 30)
        async with AsyncClient(stack.target) as client:
            silent = client.stream(voice, audio_format="float32")
            stalled = client.stream(voice, audio_format="float32")
            await stalled.send(tokens)
            for s in (silent, stalled):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in s:
                        pass
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "from the client for 0.3 s" in info.value.details()
            # both slots are free again
            results = await asyncio.gather(*[collect(client, voice, tokens) for _ in range(2)])
            assert all(audio(r).size == 30 * SAMPLES_PER_TOKEN for r in results)
    finally:
        await stack.stop()


# -- cancellation hygiene --------------------------------------------------------------------


async def test_cancelled_clients_leave_nothing_behind(models, caplog):
    """Clients killed mid-stream: their vocoder sessions go at once, flow queues empty, and no
    task or coroutine is left for the garbage collector to complain about."""
    caplog.set_level(logging.WARNING)
    stack = await start_stack(models)
    loop = asyncio.get_running_loop()
    complaints = []
    loop.set_exception_handler(lambda _loop, ctx: complaints.append(ctx["message"]))
    caught = warnings.catch_warnings(record=True)
    recorded = caught.__enter__()
    warnings.simplefilter("always")
    try:
        for round_ in range(4):
            # even rounds cancel each call; odd ones drop the whole connection (a killed process)
            client = AsyncClient(stack.target)
            streams = []
            for i in range(6):
                voice, tokens = stream_inputs(10 + i, 10, 200)
                s = client.stream(voice, audio_format="float32", request_id=f"k{round_}-{i}")
                await s.send(tokens)
                streams.append(s)
            firsts = [asyncio.ensure_future(s.__aiter__().__anext__()) for s in streams]
            await asyncio.wait(firsts, return_when=asyncio.FIRST_COMPLETED)
            if round_ % 2 == 0:
                for s in streams:
                    s.cancel()
            await client.channel.close()
            await asyncio.gather(*firsts, return_exceptions=True)
            await until(lambda: not stack.sessions(0), 2.0, "sessions outlived their clients")
        # a running CPU batch may hold the loop a while
        await until(lambda: len(stack.engine.scheduler) == 0, 30.0, "flow calls left queued")
        await until(lambda: not flow_metrics.QUEUE_DEPTH._value.get(), 2.0, "queue depth > 0")
        gc.collect()
        # not a synchronisation: a window in which the loop runs what the collected objects
        # scheduled, so a "destroyed but it is pending" warning has the chance to appear
        await asyncio.sleep(0.05)
        gc.collect()
    finally:
        await stack.stop()
        gc.collect()
        caught.__exit__(None, None, None)
        loop.set_exception_handler(None)
    texts = (
        complaints + [r.getMessage() for r in caplog.records] + [str(w.message) for w in recorded]
    )
    assert not [t for t in texts if "destroyed but it is pending" in t or "never awaited" in t]


# -- vocoder failover ------------------------------------------------------------------------


async def run_with_fault(stack, voice, tokens, fault, request_id):
    """Half the tokens, wait for the first audio, inject `fault`, then the rest."""
    async with AsyncClient(stack.target) as client:
        stream = client.stream(voice, audio_format="float32", request_id=request_id)
        half = len(tokens) // 2
        await stream.send(tokens[:half])
        chunks = stream.__aiter__()
        got = [await chunks.__anext__()]
        await fault()
        await stream.send(tokens[half:])
        await stream.end()
        got += [c async for c in chunks]
    return audio(got)


@pytest.mark.parametrize("fault", ["kill", "evict", "restart"])
async def test_vocoder_failover_is_lossless(models, fault):
    """The replica serving a stream dies (or evicts the session, or restarts) mid-stream: the
    gateway replays the stream's mel in a new session and the client's audio equals the
    fault-free run, every sample once."""
    from gateway import metrics

    stack = await start_stack(models, num_vocoders=1 if fault == "restart" else 2)
    try:
        voice, tokens = stream_inputs(30, 15, 160)
        async with AsyncClient(stack.target) as client:
            clean = audio(await collect(client, voice, tokens, request_id="clean"))
        before = sum(s.value for m in metrics.VOCODER_FAILOVERS.collect() for s in m.samples)

        async def inject():
            i = stack.serving("faulty")
            if fault == "evict":
                manager = stack.vocoders[i].service.manager
                (key,) = [k for k in manager._active if k.startswith("faulty:")]
                assert manager.cancel(key)
            else:
                await stack.kill_vocoder(i)
                if fault == "restart":
                    await stack.start_vocoder(i)

        faulty = await run_with_fault(stack, voice, tokens, inject, "faulty")
        after = sum(s.value for m in metrics.VOCODER_FAILOVERS.collect() for s in m.samples)
        assert after - before >= 1, "no failover happened: the fault missed the stream"
        assert faulty.size == clean.size == SAMPLES_PER_TOKEN * len(tokens)
        np.testing.assert_allclose(faulty, clean, rtol=0, atol=1e-4)
        for i in range(len(stack.vocoders)):
            assert "faulty" not in stack.sessions(i)
    finally:
        await stack.stop()


async def test_failover_budget_then_aborted(models):
    """--vocoder-failovers 0: a lost session ends the stream ABORTED (the client may retry)."""
    stack = await start_stack(models, "--vocoder-failovers", "0", num_vocoders=2)
    try:
        voice, tokens = stream_inputs(31, 15, 160)

        async def evict():
            manager = stack.vocoders[stack.serving("doomed")].service.manager
            (key,) = [k for k in manager._active if k.startswith("doomed:")]
            manager.cancel(key)

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await run_with_fault(stack, voice, tokens, evict, "doomed")
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert "127.0.0.1" not in info.value.details()
    finally:
        await stack.stop()


# -- flow failover and recovery, health ------------------------------------------------------


def count_calls(engine) -> list[int]:
    calls = [0]
    submit = engine.submit

    async def counted(*args, **kw):
        calls[0] += 1
        return await submit(*args, **kw)

    engine.submit = counted
    return calls


async def test_flow_replica_down_then_back_gets_traffic(models):
    """A dead flow replica costs no stream (calls go to the other one), and once it is back it
    gets calls again within about a health-check interval, not after gRPC's reconnect backoff."""
    stack = await start_stack(models, "--health-check-interval", "0.2", num_flows=2)
    try:
        voice, tokens = stream_inputs(40, 10, 60)
        async with AsyncClient(stack.target) as client:
            await stack.kill_flow(0)
            for _ in range(3):
                assert audio(await collect(client, voice, tokens)).size == 60 * SAMPLES_PER_TOKEN
            await stack.start_flow(0)
            calls = count_calls(stack.flows[0].service.engine)
            back = time.monotonic()
            while not calls[0] and time.monotonic() - back < 10:
                assert audio(await collect(client, voice, tokens)).size == 60 * SAMPLES_PER_TOKEN
        assert calls[0] > 0, "the restarted flow replica got no call in 10 s"
    finally:
        await stack.stop()


async def next_status(watch) -> int:
    return (await asyncio.wait_for(watch.__anext__(), 10)).status


async def test_gateway_health_follows_its_stages(models):
    """NOT_SERVING while no vocoder replica is reachable, SERVING again once one is back."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    stack = await start_stack(models, "--health-check-interval", "0.1")
    try:
        async with grpc.aio.insecure_channel(stack.target) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            watch = watch.__aiter__()
            assert await next_status(watch) == serving
            await stack.kill_vocoder(0)
            assert await next_status(watch) == not_serving
            await stack.start_vocoder(0)
            assert await next_status(watch) == serving
    finally:
        await stack.stop()


def test_retry_budget_bounds_retries():
    from gateway.failover import RetryBudget

    budget = RetryBudget(ratio=0.1, min_per_s=0.0, cap=5.0)
    assert sum(budget.try_retry() for _ in range(20)) == 5  # the saved-up cap
    for _ in range(30):
        budget.on_call()
    assert sum(budget.try_retry() for _ in range(20)) == 3  # 10% of 30 calls


# -- limits ----------------------------------------------------------------------------------


async def test_streams_per_client_are_bounded(models):
    stack = await start_stack(models, "--max-streams-per-client", "2")
    try:
        voice, tokens = stream_inputs(50, 10, 30)
        async with AsyncClient(stack.target) as client:
            held = [client.stream(voice, audio_format="float32") for _ in range(2)]
            for s in held:
                await s.send(tokens[:5])  # admitted, then idle: both slots taken
            await until(lambda: stack.gateway_server_streams() >= 2, what="streams not admitted")
            third = await collect(client, voice, tokens)
            assert isinstance(third, grpc.aio.AioRpcError) and third.code() == RE
            assert "--max-streams-per-client" in third.details()
            for s in held:
                s.cancel()
            # the slots come back
            await until(lambda: not stack.gateway_server_streams(), what="slots not freed")
            assert audio(await collect(client, voice, tokens)).size == 30 * SAMPLES_PER_TOKEN
    finally:
        await stack.stop()


def test_voices_are_owned_by_their_clients():
    from gateway.servicer import VoiceRegistry
    from token2wav.errors import NotFound

    reg = VoiceRegistry(max_voices=100, max_per_client=2)
    voices = [stream_inputs(60 + i, 5, 1)[0] for i in range(4)]
    a0, _ = reg.register(voices[0], "a")
    shared, created = reg.register(voices[1], "a")
    assert created
    assert reg.register(voices[1], "b") == (shared, True)  # b registers the same voice
    with pytest.raises(NotFound):
        reg.get(a0, "b")  # not b's: as if unknown
    with pytest.raises(NotFound):
        reg.delete(a0, "b")
    # b past its quota evicts only its own voices
    for v in voices[2:]:
        reg.register(v, "b")
    assert reg.get(a0, "a") is voices[0]
    assert reg.get(shared, "a") is voices[1]
    with pytest.raises(NotFound):
        reg.get(shared, "b")  # b's oldest, evicted from b only
    reg.delete(shared, "a")
    with pytest.raises(NotFound):
        reg.get(shared, "a")


def test_message_caps_fit_the_largest_legal_messages():
    from flow_service.config import build_parser as flow_parser
    from gateway.config import build_parser as gateway_parser
    from token2wav import MAX_FRAMES, MAX_PROMPT_TOKENS
    from token2wav.tensors import make_voice
    from vocoder_service.config import build_parser as vocoder_parser

    caps = {
        name: build().parse_args([]).max_message_mb << 20
        for name, build in [
            ("gateway", gateway_parser),
            ("flow", flow_parser),
            ("vocoder", vocoder_parser),
        ]
    }
    n = MAX_PROMPT_TOKENS  # the largest voice, with 300 s of tokens: the largest flow call
    voice = make_voice(
        np.zeros(n, np.int64), np.zeros((2 * n, 80), np.float32), np.ones(192, np.float32)
    )
    flow_call = len(voice.to_proto().SerializeToString()) + MAX_FRAMES // 2 * 4
    gateway_audio = 1003 * SAMPLES_PER_TOKEN * 4  # float32 chunk at the largest hop
    vocoder_audio = MAX_FRAMES * 480 * 4  # a 300 s non-streaming chunk
    flow_mel = 2 * 1003 * 80 * 4  # the mel of a 1003-token chunk
    largest = {"gateway": gateway_audio, "flow": max(flow_call, flow_mel), "vocoder": vocoder_audio}
    for name, size in largest.items():
        assert size < caps[name] <= 4 * size, (name, size, caps[name])


def test_soak_counts_lost_and_duplicated_samples():
    from types import SimpleNamespace

    from bench.soak import Tally, account

    def chunk(offset, n):
        return SimpleNamespace(sample_offset=offset, samples=np.zeros(n, np.float32))

    tally = Tally()
    account([chunk(0, 960), chunk(960, 960)], 2, tally)
    assert (tally.samples_lost, tally.samples_duplicated) == (0, 0)
    account([chunk(0, 960), chunk(480, 960), chunk(1920, 960)], 3, tally)  # overlap, gap
    assert (tally.samples_lost, tally.samples_duplicated) == (480, 480)
    account([chunk(0, 960)], 2, tally)  # ended short
    assert tally.samples_lost == 480 + 960


async def test_gateway_without_health_checks_serves(models):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stack = await start_stack(models, "--health-check-interval", "0")
    try:
        async with grpc.aio.insecure_channel(stack.target) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await stack.stop()
