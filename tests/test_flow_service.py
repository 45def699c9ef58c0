"""flow_service over real gRPC on loopback (small preset, CPU): batching across streams keeps
each stream's mel equal to its solo result; bad, cancelled and expired calls fail alone;
overload and drain answer with the documented codes."""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from _stack import start_flow, until

from flow_service.engine import FlowEngine
from flow_service.model import FlowRequest, Voice, load_flow
from flow_service.scheduler import BatchPolicy
from token2wav.tensors import decode, encode, make_voice
from token2wav.v1 import flow_pb2, flow_pb2_grpc

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return load_flow(None, preset="small")


class GatedModel(torch.nn.Module):
    """The real model behind a gate: a batch waits in the runner until the test sets `gate`,
    so the runner is busy exactly while the test acts (no sleeps)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.gate = threading.Event()
        self.batch_sizes: list[int] = []

    def generate(self, chunks, **kw):
        self.batch_sizes.append(len(chunks))
        if not self.gate.wait(timeout=30):
            raise TimeoutError("test gate never opened")
        return self.inner.generate(chunks, **kw)


class HeldSteps(torch.nn.Module):
    """The real model, whose batches of later chunks (no first chunk in them) can be held at
    the end of a solver step, before the engine looks at the queue: tests line calls up there.
    `hold()`: such a batch stops at its next step end; `release(n)`: n more step ends may pass
    (all of them by default)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.decoder = inner.decoder  # the engine graphs decoder.estimator on CUDA
        self.cond = threading.Condition()
        self.passed = 0  # step ends of held batches that went on
        self.limit = math.inf  # how many may go on
        self.batches: list[list[int]] = []  # token_offset of each request, per batch

    def hold(self) -> None:
        with self.cond:
            self.limit = self.passed

    def release(self, n: float = math.inf) -> None:
        with self.cond:
            self.limit += n
            self.cond.notify_all()

    def generate(self, chunks, between_steps=None, **kw):
        self.batches.append([c.token_offset for c in chunks])
        hold = all(c.token_offset > 0 for c in chunks)

        def step_done():
            if hold:
                with self.cond:
                    if not self.cond.wait_for(lambda: self.passed < self.limit, timeout=30):
                        raise TimeoutError("test never released the held batch")
                    self.passed += 1
            if between_steps is not None:
                between_steps()

        return self.inner.generate(chunks, between_steps=step_done, **kw)


def listening(port: int) -> bool:
    """Whether a TCP connect to the port on loopback is accepted."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


async def start(model, *flags):
    server = await start_flow(model, *flags)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    return server, server.service.engine, channel


async def stop(server, engine, channel):
    await channel.close()
    await server.drain()  # stops the engine too


def make_stream(seed: int, n_prompt: int, n_tokens: int):
    rng = np.random.default_rng(seed)
    voice = make_voice(
        rng.integers(0, 6561, n_prompt),
        rng.standard_normal((2 * n_prompt, 80)).astype(np.float32),
        rng.standard_normal(192).astype(np.float32),
    )
    return voice, rng.integers(0, 6561, n_tokens)


def request_for(voice, tokens, offset, finalize, streaming, **kw):
    return flow_pb2.GenerateRequest(
        request_id=kw.pop("request_id", "r"),
        inline_voice=voice.to_proto(),
        tokens=encode(np.asarray(tokens, np.int32)),
        token_offset=offset,
        finalize=finalize,
        streaming=streaming,
        **kw,
    )


def chunk_request(voice, tokens, offset, finalize, streaming) -> FlowRequest:
    v = Voice(
        torch.from_numpy(voice.prompt_token),
        torch.from_numpy(voice.prompt_feat),
        torch.from_numpy(voice.embedding),
    )
    return FlowRequest(
        v, torch.from_numpy(np.asarray(tokens, np.int64)), offset, finalize, streaming
    )


def solo(model, voice, tokens, offset, finalize, streaming):
    req = chunk_request(voice, tokens, offset, finalize, streaming)
    return model.generate([req])[0].float().cpu().numpy()


def close(a, b):
    return np.abs(a - b).max() <= 1e-4 * max(1e-6, np.abs(b).max())


CASES = [  # (prompt tokens, target tokens, offset, finalize, streaming)
    (p, n, o, f, s)
    for i, (p, n, o, f, s) in enumerate(
        [
            (25, 28, 0, False, True),
            (10, 40, 15, False, True),
            (40, 60, 25, True, False),
            (7, 9, 0, True, True),
            (30, 78, 25, False, True),
            (12, 20, 3, True, False),
            (50, 31, 0, False, True),
            (18, 55, 40, True, True),
        ]
        * 4
    )
]


async def test_32_concurrent_streams_match_solo_and_batch(model):
    slow = GatedModel(model)  # the first batch holds the runner until the rest queue up
    server, engine, channel = await start(slow, "--max-wait-ms", "20")
    try:
        stub = flow_pb2_grpc.FlowStub(channel)
        streams = [make_stream(100 + i, p, n) for i, (p, n, *_) in enumerate(CASES)]
        calls = [
            asyncio.ensure_future(
                stub.Generate(request_for(v, t, o, f, s, request_id=f"s{i}"), timeout=60)
            )
            for i, ((v, t), (_, _, o, f, s)) in enumerate(zip(streams, CASES))
        ]
        await until(lambda: slow.batch_sizes)
        await until(lambda: slow.batch_sizes[0] + len(engine.scheduler) == len(CASES))
        slow.gate.set()
        responses = await asyncio.gather(*calls)
        for (v, t), (p, n, o, f, s), resp in zip(streams, CASES, responses):
            mel = decode(resp.mel, "mel", shape=(80, None))
            ref = solo(model, v, t, o, f, s)
            assert mel.shape == ref.shape
            assert close(mel, ref), f"batched != solo for case {(p, n, o, f, s)}"
            assert resp.voice_id == v.voice_id
        assert max(slow.batch_sizes) > 1, slow.batch_sizes
        assert max(r.timing.batch_size for r in responses) > 1
    finally:
        await stop(server, engine, channel)


def bad_requests(voice, tokens):
    good = request_for(voice, tokens, 0, False, True)
    cases = {}

    def variant(name, mutate):
        r = flow_pb2.GenerateRequest()
        r.CopyFrom(good)
        mutate(r)
        cases[name] = r

    variant(
        "tokens[2]", lambda r: r.tokens.CopyFrom(encode(np.array([1, 2, 7000, 4, 5], np.int32)))
    )
    variant("tokens", lambda r: r.tokens.CopyFrom(encode(np.zeros(0, np.int32))))
    variant("token_offset", lambda r: setattr(r, "token_offset", len(tokens)))
    variant(
        "inline_voice.prompt_feat",
        lambda r: r.inline_voice.prompt_feat.CopyFrom(encode(voice.prompt_feat[:-1])),
    )
    variant(
        "inline_voice.embedding",
        lambda r: r.inline_voice.embedding.CopyFrom(encode(voice.embedding[:100])),
    )
    variant(
        "inline_voice.prompt_token[0]",
        lambda r: r.inline_voice.prompt_token.CopyFrom(
            encode(np.full(len(voice.prompt_token), 9999, np.int32))
        ),
    )
    variant("voice", lambda r: r.ClearField("inline_voice"))
    variant("request_id", lambda r: setattr(r, "request_id", "x" * 200))
    nan_feat = voice.prompt_feat.copy()
    nan_feat[3, 3] = np.nan
    variant(
        "inline_voice.prompt_feat", lambda r: r.inline_voice.prompt_feat.CopyFrom(encode(nan_feat))
    )
    # fewer than the 3 lookahead tokens on a non-final chunk
    variant("tokens", lambda r: r.tokens.CopyFrom(encode(np.array([1, 2], np.int32))))
    return cases, good


async def test_bad_fields_rejected_alone(model):
    server, engine, channel = await start(model)
    try:
        stub = flow_pb2_grpc.FlowStub(channel)
        voice, tokens = make_stream(7, 20, 30)
        bad, good = bad_requests(voice, tokens)
        results = await asyncio.gather(
            *[stub.Generate(r, timeout=30) for r in bad.values()],
            *[stub.Generate(good, timeout=30) for _ in range(3)],
            return_exceptions=True,
        )
        for field, res in zip(bad, results):
            assert isinstance(res, grpc.aio.AioRpcError), field
            assert res.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, res.details())
            assert res.details().startswith(field.split("[")[0]), (field, res.details())
        ref = solo(model, voice, tokens, 0, False, True)
        for res in results[len(bad) :]:
            assert close(decode(res.mel, "mel"), ref)
        # An unknown voice id is NOT_FOUND so the caller can resend the voice inline.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            req = request_for(voice, tokens, 0, False, True)
            req.voice_id = "v1-" + "0" * 32
            await stub.Generate(req, timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # ... and a voice seen inline is then usable by id.
        req = request_for(voice, tokens, 0, False, True)
        req.voice_id = voice.voice_id
        assert close(decode((await stub.Generate(req, timeout=10)).mel, "mel"), ref)
    finally:
        await stop(server, engine, channel)


async def test_cancel_and_deadline_leave_others_intact(model):
    slow = GatedModel(model)
    server, engine, channel = await start(slow, "--max-batch-size", "4")
    try:
        stub = flow_pb2_grpc.FlowStub(channel)
        streams = [make_stream(300 + i, 15 + i, 30 + i) for i in range(8)]
        reqs = [
            request_for(v, t, 0, False, True, request_id=f"c{i}")
            for i, (v, t) in enumerate(streams)
        ]
        blocker = stub.Generate(reqs[0], timeout=30)  # occupies the runner
        await until(lambda: slow.batch_sizes)  # the runner holds it
        keep = [stub.Generate(r, timeout=30) for r in reqs[1:5]]
        cancelled = [stub.Generate(r, timeout=30) for r in reqs[5:7]]
        expiring = asyncio.ensure_future(stub.Generate(reqs[7], timeout=0.1))
        queued = lambda: {c.payload.cache_key for c in engine.scheduler.waiting}  # noqa: E731
        await until(lambda: {"c5", "c6"} <= queued())  # the calls to cancel wait in the queue
        for c in cancelled:
            c.cancel()
        await until(expiring.done, what="the 0.1 s deadline never passed")  # while queued
        slow.gate.set()
        results = await asyncio.gather(blocker, *keep, expiring, *cancelled, return_exceptions=True)
        kept = results[:5]
        for (v, t), res in zip(streams[:5], kept):
            assert close(decode(res.mel, "mel"), solo(model, v, t, 0, False, True))
        assert isinstance(results[5], grpc.aio.AioRpcError)
        assert results[5].code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert all(isinstance(r, asyncio.CancelledError) for r in results[6:])
        await until(lambda: len(engine.scheduler) == 0)  # nothing left behind in the queue
        assert sum(slow.batch_sizes) <= 6  # cancelled/expired calls never reached the model
    finally:
        await stop(server, engine, channel)


async def test_overload_is_rejected_quickly(model):
    slow = GatedModel(model)
    server, engine, channel = await start(slow, "--max-queue", "3", "--max-batch-size", "1")
    try:
        stub = flow_pb2_grpc.FlowStub(channel)
        voice, tokens = make_stream(9, 10, 20)
        req = request_for(voice, tokens, 0, False, True)
        # One call first, held by the runner, then three that wait: sent all at once, the four
        # could all reach the queue before the runner took one (a loaded machine), and the
        # fourth would then be the one refused.
        first = [stub.Generate(req, timeout=30)]
        await until(lambda: slow.batch_sizes)
        first += [stub.Generate(req, timeout=30) for _ in range(3)]
        await until(lambda: len(engine.scheduler) == 3)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(req, timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Answered at once, not after a place freed up: the runner is held, the queue still
        # holds the same three (no wall-clock bound, which a loaded 2-core machine breaks).
        assert len(engine.scheduler) == 3
        slow.gate.set()
        await asyncio.gather(*first)
    finally:
        await stop(server, engine, channel)


async def test_drain_finishes_in_flight_and_refuses_new(model):
    args = ["--grace-period", "10"]
    slow = GatedModel(model)
    server, engine, channel = await start(slow, *args)
    stub = flow_pb2_grpc.FlowStub(channel)
    voice, tokens = make_stream(11, 10, 20)
    req = request_for(voice, tokens, 0, False, True)
    in_flight = asyncio.ensure_future(stub.Generate(req, timeout=30))
    await until(lambda: slow.batch_sizes)  # the runner holds it
    drain = asyncio.ensure_future(server.drain())
    await until(lambda: not listening(server.port))  # the listener closed
    assert not in_flight.done()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(req, timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    slow.gate.set()
    resp = await in_flight
    assert decode(resp.mel, "mel").shape == (80, 2 * (20 - 3))
    await drain
    await channel.close()
    await engine.stop()


async def test_first_chunks_run_between_steps_of_a_long_batch(model):
    """First chunks that arrive while a batch of later chunks runs are served between two of
    its solver steps, and every result still equals its solo result."""
    slow = HeldSteps(model)
    server, engine, channel = await start(slow)
    try:
        stub = flow_pb2_grpc.FlowStub(channel)
        later = [(make_stream(500 + i, 20, 60), 25, i == 2) for i in range(3)]
        first = [(make_stream(600 + i, 20, 28), 0, False) for i in range(2)]
        done_at: dict[str, float] = {}

        async def call(name, stream, offset, finalize):
            (voice, tokens) = stream
            req = request_for(voice, tokens, offset, finalize, True, request_id=name)
            resp = await stub.Generate(req, timeout=60)
            done_at[name] = time.monotonic()
            return resp

        slow.hold()  # the first batch of later chunks holds after its first step
        long_batch = [asyncio.ensure_future(call(f"later{i}", *c)) for i, c in enumerate(later)]
        await until(lambda: len(slow.batches) == 1)
        urgent = [asyncio.ensure_future(call(f"first{i}", *c)) for i, c in enumerate(first)]
        await until(lambda: engine.scheduler.num_first_chunks_waiting == 2)
        slow.release()
        responses = await asyncio.gather(*long_batch, *urgent)

        for ((voice, tokens), offset, finalize), resp in zip([*later, *first], responses):
            mel = decode(resp.mel, "mel", shape=(80, None))
            assert close(mel, solo(model, voice, tokens, offset, finalize, True))
        last_first = max(done_at[f"first{i}"] for i in range(2))
        first_later = min(done_at[f"later{i}"] for i in range(3))
        assert all(off > 0 for off in slow.batches[0])
        assert engine.num_preemptions == 1
        assert slow.batches[1] == [0, 0]  # both first chunks, as one batch inside it
        assert all(o > 0 for batch in slow.batches[2:] for o in batch)
        assert last_first < first_later  # served before the running batch ended
        assert all(r.timing.batch_size == 2 for r in responses[3:])
    finally:
        await stop(server, engine, channel)


@pytest.mark.gpu
async def test_preemption_on_cuda_sharing_a_graph_changes_no_result():
    """On CUDA the urgent batch replays the very graph the preempted batch uses (same rows
    bucket, same frames bucket); the preempted batch's next replay must see its own inputs
    again (the graph runner re-copies any input that is not the tensor it copied last). The
    same calls without preemption run as the same two batches: results must be identical."""
    cuda_model = load_flow(None, preset="small", device="cuda")
    # Later chunks: (20 + 60 - 3) x 2 = 154 frames; first chunks: (30 + 28 - 3) x 2 = 110;
    # both run as 2 rows padded to 200 frames, i.e. through one graph.
    later = [(*make_stream(700 + i, 20, 60), 25, False, True) for i in range(2)]
    first = [(*make_stream(800 + i, 30, 28), 0, False, True) for i in range(2)]

    async def run(preempt: bool):
        slow = HeldSteps(cuda_model)
        engine = FlowEngine(slow, BatchPolicy(), graph_max_batch=8, preempt=preempt)
        engine.start()
        try:
            slow.hold()
            running = [asyncio.ensure_future(engine.submit(chunk_request(*c))) for c in later]
            await until(lambda: len(slow.batches) == 1)
            urgent = [asyncio.ensure_future(engine.submit(chunk_request(*c))) for c in first]
            await until(lambda: engine.scheduler.num_first_chunks_waiting == 2)
            slow.release()
            results = await asyncio.gather(*running, *urgent)
        finally:
            await engine.stop()
        assert sorted(map(sorted, slow.batches)) == [[0, 0], [25, 25]]
        assert len(engine.runner.graphs) == 1  # both batches replayed the one graph
        return engine.num_preemptions, [r.mel for r in results]

    preempted, with_preemption = await run(True)
    not_preempted, without = await run(False)
    assert (preempted, not_preempted) == (1, 0)
    for a, b in zip(with_preemption, without):
        assert torch.equal(a, b)


class FailsOnFirstChunks(HeldSteps):
    """Held steps, and any batch holding a first chunk raises: a failing urgent batch."""

    def generate(self, chunks, between_steps=None, **kw):
        if any(c.token_offset == 0 for c in chunks):
            self.batches.append([c.token_offset for c in chunks])
            raise RuntimeError("injected failure")
        return super().generate(chunks, between_steps=between_steps, **kw)


async def test_failing_urgent_batch_fails_only_its_calls(model):
    slow = FailsOnFirstChunks(model)
    server, engine, channel = await start(slow)
    try:
        stub = flow_pb2_grpc.FlowStub(channel)
        later = [(make_stream(900 + i, 20, 60), 25) for i in range(2)]
        first = make_stream(950, 20, 28)

        def req(stream, offset, name):
            return request_for(*stream, offset, False, True, request_id=name)

        slow.hold()
        running = [
            asyncio.ensure_future(stub.Generate(req(s, o, f"l{i}"), timeout=60))
            for i, (s, o) in enumerate(later)
        ]
        await until(lambda: len(slow.batches) == 1)
        failing = asyncio.ensure_future(stub.Generate(req(first, 0, "f"), timeout=60))
        await until(lambda: engine.scheduler.num_first_chunks_waiting == 1)
        slow.release(1)  # one step end: the urgent batch runs there, then the held one stops
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await failing
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert not any(c.done() for c in running)  # it failed between their steps
        slow.release()
        for ((voice, tokens), offset), resp in zip(later, await asyncio.gather(*running)):
            mel = decode(resp.mel, "mel", shape=(80, None))
            assert close(mel, solo(model, voice, tokens, offset, False, True))
        assert engine.num_preemptions == 1 and len(engine.scheduler) == 0
    finally:
        await stop(server, engine, channel)


def test_graph_row_buckets_are_powers_of_two_then_multiples_of_eight():
    from flow_service.runner import graph_rows

    assert [graph_rows(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        16,
        24,
        40,
        64,
    ]
    assert all(graph_rows(n) >= n for n in range(1, 200))
