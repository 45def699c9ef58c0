"""Replica discovery: a replica that leaves DNS keeps serving the calls already on it."""

from __future__ import annotations

import asyncio
import socket

import grpc
import numpy as np
import pytest
from _stack import until

from gateway.routing import ReplicaSet, parse_spec, rendezvous, rendezvous_order

METHOD = "/t2w.test.Slow/Wait"


async def _slow_server(arrived: asyncio.Event, release: asyncio.Event):
    """A server whose one method sets `arrived`, then answers once the test sets `release`."""

    async def wait(request: bytes, context) -> bytes:
        arrived.set()
        await release.wait()  # the work the call stands for, as long as the test needs
        return b"done:" + request

    handler = grpc.method_handlers_generic_handler(
        "t2w.test.Slow", {"Wait": grpc.unary_unary_rpc_method_handler(wait)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("0.0.0.0:0")  # 127.0.0.1 and 127.0.0.2 both reach it
    await server.start()
    return server, port


def _fake_dns(monkeypatch, answers: dict[str, list[str]]) -> None:
    """Make the running loop's getaddrinfo answer from `answers` (mutable: tests edit it)."""

    async def getaddrinfo(host, port, **kwargs):
        if host not in answers or not answers[host]:
            raise socket.gaierror(f"no such host {host}")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)


async def _call_through(replicas: ReplicaSet, addr: str, payload: bytes) -> bytes:
    call = replicas.channel(addr).unary_unary(METHOD)
    return await call(payload, timeout=30)


async def _start_call_on_leaving_replica(monkeypatch, grace_s: float, release: asyncio.Event):
    arrived = asyncio.Event()
    server, port = await _slow_server(arrived, release)
    answers = {"replicas.test": ["127.0.0.1", "127.0.0.2"]}
    _fake_dns(monkeypatch, answers)
    replicas = ReplicaSet(f"dns:///replicas.test:{port}", refresh_s=0.0, retire_grace_s=grace_s)
    assert await replicas.addresses() == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
    leaving = f"127.0.0.2:{port}"
    call = asyncio.create_task(_call_through(replicas, leaving, b"x"))
    await asyncio.wait_for(arrived.wait(), 10)  # the call is in before the replica leaves
    answers["replicas.test"] = ["127.0.0.1"]
    assert await replicas.addresses() == [f"127.0.0.1:{port}"]
    assert replicas.num_retiring == 1
    return server, replicas, call


@pytest.mark.asyncio
async def test_call_on_a_replica_that_left_dns_finishes(monkeypatch):
    release = asyncio.Event()
    server, replicas, call = await _start_call_on_leaving_replica(monkeypatch, 30.0, release)
    try:
        assert not call.done()  # still running on the replica that left
        release.set()
        assert await call == b"done:x"
        await until(
            lambda: replicas.num_retiring == 0, timeout=10
        )  # closes once its last call ends
        # New calls go to the replica still in DNS.
        addr = await replicas.pick("some-request-id")
        assert addr.startswith("127.0.0.1:")
    finally:
        await replicas.close()
        await server.stop(None)


@pytest.mark.asyncio
async def test_retire_grace_bounds_how_long_a_leaving_replica_is_kept(monkeypatch):
    # the call is never released: only the 0.2 s grace can end it
    server, replicas, call = await _start_call_on_leaving_replica(monkeypatch, 0.2, asyncio.Event())
    try:
        # grpc.aio reports a call its own channel cancelled as asyncio.CancelledError.
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, timeout=3.0)
        assert call.cancelled() or isinstance(call.exception(), asyncio.CancelledError)
        await until(lambda: replicas.num_retiring == 0, timeout=10)
    finally:
        await replicas.close()
        await server.stop(None)


@pytest.mark.asyncio
async def test_failed_lookup_keeps_known_replicas(monkeypatch):
    answers = {"replicas.test": ["127.0.0.1", "127.0.0.2"]}
    _fake_dns(monkeypatch, answers)
    replicas = ReplicaSet("dns:///replicas.test:5000", refresh_s=0.0)
    try:
        first = await replicas.addresses()
        answers["replicas.test"] = []  # resolver failure (e.g. DNS outage during a rollout)
        assert await replicas.addresses() == first
        assert replicas.num_retiring == 0
    finally:
        await replicas.close()


def test_spec_parsing_and_rendezvous_stability():
    assert parse_spec("dns:///flow:50051") == ([], ("flow", 50051))
    assert parse_spec("a:1, b:2") == (["a:1", "b:2"], None)
    for bad in ("dns:///flow", "a:x", " , "):
        with pytest.raises(ValueError):
            parse_spec(bad)
    addrs = [f"10.0.0.{i}:1" for i in range(4)]
    keys = [f"req-{i}" for i in range(400)]
    before = {k: rendezvous(k, addrs) for k in keys}
    after = {k: rendezvous(k, addrs[:3]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    # Removing a replica moves exactly the keys that were on it, and spreads them out.
    assert moved == [k for k in keys if before[k] == addrs[3]]
    assert 50 < len(moved) < 150
    assert len(set(after[k] for k in moved)) == 3


@pytest.mark.skipif(not hasattr(asyncio.Task, "cancelling"), reason="needs Python >= 3.11")
async def test_a_call_cancelled_under_a_stream_fails_it_instead_of_hanging():
    """A downstream call whose channel closes under it raises CancelledError inside the
    stream's task: the stream must end ABORTED, while cancelling the task itself (the client
    went away) stays a plain cancellation."""
    from gateway.pipeline import PipelineLimits, StreamPipeline, StreamSetup
    from gateway.schedule import ScheduleConfig
    from token2wav.errors import Aborted

    setup = StreamSetup("r", _Voice(), 0, ScheduleConfig(), None)
    pipeline = StreamPipeline(setup, None, None, PipelineLimits())

    async def call_cancelled_by_its_channel():
        raise asyncio.CancelledError()  # what grpc.aio raises for a locally cancelled call

    await asyncio.gather(
        pipeline._spawn(call_cancelled_by_its_channel(), "vocoder"), return_exceptions=True
    )
    assert isinstance(pipeline._failure.exception(), Aborted)

    pipeline = StreamPipeline(setup, None, None, PipelineLimits())
    task = pipeline._spawn(asyncio.Event().wait(), "vocoder")  # runs until cancelled
    await asyncio.sleep(0)  # one turn of the loop: the task starts and waits
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and not pipeline._failure.done()


class _Voice:
    num_prompt_tokens = 75


async def test_ejected_replica_is_tried_last_until_checked():
    rs = ReplicaSet("a:1,b:2,c:3")
    rs.eject("a:1")
    assert "a:1" not in rs.unhealthy  # no health checks: nothing would ever undo it
    rs.health_checked = True
    rs.eject("a:1")
    for _ in range(3):
        assert (await rs.round_robin())[-1] == "a:1"
    assert await rs.pick("any-key", exclude={"b:2", "c:3"}) == "a:1"  # the only one left
    rs.unhealthy = set()  # a health round found it SERVING
    assert {(await rs.round_robin())[0] for _ in range(3)} == {"a:1", "b:2", "c:3"}
    await rs.close()


class _FakeFlow:
    """A Flow servicer that records which stream called it; `down` answers UNAVAILABLE."""

    def __init__(self, down: bool = False):
        self.down = down
        self.calls: list[str] = []

    async def Generate(self, request, context):
        from token2wav.tensors import encode
        from token2wav.v1 import flow_pb2

        if self.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        self.calls.append(request.request_id)
        frames = 2 * (len(request.tokens.data) // 4 - 3 - request.token_offset)
        return flow_pb2.GenerateResponse(mel=encode(np.zeros((80, frames), np.float32)))


async def _fake_flow_servers(fakes: list[_FakeFlow]) -> tuple[list, list[str]]:
    from token2wav.v1 import flow_pb2_grpc

    servers, addrs = [], []
    for fake in fakes:
        server = grpc.aio.server()
        flow_pb2_grpc.add_FlowServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        addrs.append(f"127.0.0.1:{port}")
    return servers, addrs


@pytest.mark.asyncio
async def test_flow_calls_of_a_stream_stick_to_one_replica_and_fail_over(monkeypatch):
    """A stream's flow calls all go to its rendezvous replica (its prefix cache is there); when
    that replica answers UNAVAILABLE they go to the next-ranked one, never an error."""
    from bench.workload import make_bench_voice
    from gateway.downstream import FlowClient

    fakes = [_FakeFlow() for _ in range(3)]
    servers, addrs = await _fake_flow_servers(fakes)
    _fake_dns(monkeypatch, {})  # a static list: nothing is resolved
    replicas = ReplicaSet(",".join(addrs))
    client = FlowClient(replicas)
    voice = make_bench_voice(0, 0, 10)
    tokens = np.arange(40, dtype=np.int64)

    async def stream(rid: str, calls: int = 3) -> None:
        for seq in range(calls):
            out = await client.generate(
                request_id=rid,
                seq=seq,
                voice=voice,
                tokens=tokens[: 10 * (seq + 1) + 3],
                token_offset=10 * seq,
                finalize=False,
                streaming=True,
                timeout=10,
            )
            assert out.num_frames == 20 and list(out.mel.shape) == [80, 20]

    try:
        rids = [f"stream-{i}" for i in range(12)]
        for rid in rids:
            await stream(rid)
        for rid in rids:
            home = addrs.index(rendezvous(rid, addrs))
            assert [f.calls.count(rid) for f in fakes] == [3 if i == home else 0 for i in range(3)]
        assert len({rendezvous(rid, addrs) for rid in rids}) > 1  # streams spread out
        # the home replica of a stream goes down: its calls move to its second-ranked replica
        rid = "stream-failover"
        first, second = (addrs.index(a) for a in rendezvous_order(rid, addrs)[:2])
        fakes[first].down = True
        await stream(rid)
        assert fakes[second].calls.count(rid) == 3
        assert sum(f.calls.count(rid) for f in fakes) == 3
    finally:
        await replicas.close()
        for server in servers:
            await server.stop(None)
