"""Resuming a stream (StreamConfig.resume_from_sample): the server skips exactly the samples the
client has, and the client library resumes by itself on another gateway when its own dies.

The oracle is an undisturbed stream through the same stack: resumed audio is recomputed, so it
must equal that stream's samples [N:] within fp32 rounding, with seq and sample_offset
continuing its numbering."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from _stack import start_stack, stream_inputs, until

from bench.soak import Tally, book_failure, failed, references, settle
from flow_service.model import load_flow
from gateway.client import AsyncClient, Client, decode_audio, split_targets
from token2wav import SAMPLES_PER_TOKEN
from token2wav.v1 import gateway_pb2, gateway_pb2_grpc
from vocoder_service.model import load_hift

torch.set_num_threads(1)

IA = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def models():
    return load_flow(None, preset="small"), load_hift(None, preset="small")


def _messages(voice, tokens, resume=0, fmt=gateway_pb2.AUDIO_FORMAT_FLOAT32, end=True):
    cfg = gateway_pb2.StreamConfig(request_id="r", audio_format=fmt, resume_from_sample=resume)
    cfg.inline_voice.CopyFrom(voice.to_proto())
    msgs = [gateway_pb2.SynthesizeRequest(config=cfg)]
    msgs.append(gateway_pb2.SynthesizeRequest(tokens=gateway_pb2.TokenChunk(tokens=tokens)))
    if end:
        msgs.append(gateway_pb2.SynthesizeRequest(end=gateway_pb2.EndOfInput()))
    return msgs


async def _run(target, messages):
    """(responses, None) or (None, (code, details)), from the sync stub off the loop."""

    def call():
        with grpc.insecure_channel(target) as ch:
            try:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                return list(stub.Synthesize(iter(messages), timeout=60)), None
            except grpc.RpcError as exc:
                return None, (exc.code(), exc.details())

    return await asyncio.to_thread(call)


def _check_contiguous(msgs, first_offset, total):
    offset = first_offset
    for prev, m in zip([None, *msgs], msgs):
        assert m.sample_offset == offset
        if prev is not None:
            assert m.seq == prev.seq + 1
        offset += m.num_samples
    assert offset == total
    assert msgs[-1].is_final and not any(m.is_final for m in msgs[:-1])


async def test_server_resume_sends_exactly_the_samples_from_n(models):
    stack = await start_stack(models)
    try:
        voice, tokens = stream_inputs(5, 30, 160)
        ids = [int(t) for t in tokens]
        total = SAMPLES_PER_TOKEN * len(ids)
        full, err = await _run(stack.target, _messages(voice, ids))
        assert err is None and len(full) >= 3
        ref = np.concatenate([decode_audio(m) for m in full])
        assert ref.size == total
        boundary = full[1].sample_offset
        for n, seq in [(boundary, 1), (boundary + 123, 1), (full[-1].sample_offset - 1, None)]:
            out, err = await _run(stack.target, _messages(voice, ids, resume=n))
            assert err is None, (n, err)
            want_seq = seq if seq is not None else full[-1].seq - 1
            assert out[0].seq == want_seq and out[0].sample_offset == n
            _check_contiguous(out, n, total)
            got = np.concatenate([decode_audio(m) for m in out])
            np.testing.assert_allclose(got, ref[n:], atol=1e-5, rtol=0)
        # Resumed at the very end: one empty final chunk ends the stream.
        out, err = await _run(stack.target, _messages(voice, ids, resume=total))
        assert err is None and len(out) == 1
        assert out[0].is_final and out[0].num_samples == 0 and out[0].sample_offset == total
        # PCM16 is cut the same way (its rounding of the same floats).
        out, err = await _run(
            stack.target,
            _messages(voice, ids, resume=boundary + 7, fmt=gateway_pb2.AUDIO_FORMAT_PCM16),
        )
        assert err is None
        pcm = np.concatenate([decode_audio(m) for m in out])
        np.testing.assert_allclose(pcm, ref[boundary + 7 :], atol=1.01 / 32767, rtol=0)
    finally:
        await stack.stop()


async def test_bad_resume_values_are_refused_naming_the_field(models):
    stack = await start_stack(models)
    try:
        voice, tokens = stream_inputs(6, 10, 40)
        ids = [int(t) for t in tokens]
        total = SAMPLES_PER_TOKEN * len(ids)
        _, err = await _run(stack.target, _messages(voice, ids, resume=total + 1))
        assert err[0] == IA and err[1].startswith("config.resume_from_sample:"), err
        _, err = await _run(stack.target, _messages(voice, ids, resume=1 << 40))
        assert err[0] == IA and err[1].startswith("config.resume_from_sample:"), err
        wav = gateway_pb2.AUDIO_FORMAT_WAV
        _, err = await _run(stack.target, _messages(voice, ids, resume=100, fmt=wav))
        assert err[0] == IA and err[1].startswith("config.resume_from_sample:"), err
    finally:
        await stack.stop()


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_client_resumes_on_the_other_gateway_when_its_own_dies(models, sync):
    stack = await start_stack(models)
    second = await stack.another_gateway()
    try:
        voice, tokens = stream_inputs(7, 30, 200)
        total = SAMPLES_PER_TOKEN * len(tokens)
        async with AsyncClient(f"127.0.0.1:{second.port}") as alone:
            stream = alone.stream(voice)
            await stream.send(tokens)
            await stream.end()
            ref = np.concatenate([c.samples async for c in stream])
        assert ref.size == total
        targets = [stack.target, f"127.0.0.1:{second.port}"]

        async def kill_serving():
            gateway, stack.gateway = stack.gateway, None
            await gateway.kill()  # hard: its streams end UNAVAILABLE

        if sync:
            loop = asyncio.get_running_loop()

            def run():
                with Client(targets, resume_attempts=2) as client:
                    stream = client.stream(voice, request_id="resumed")
                    stream.send(tokens[:80])
                    chunks = []
                    for chunk in stream:
                        chunks.append(chunk)
                        if len(chunks) == 1:
                            asyncio.run_coroutine_threadsafe(kill_serving(), loop).result()
                            stream.send(tokens[80:])
                            stream.end()
                return client, stream, chunks

            client, stream, chunks = await asyncio.to_thread(run)
        else:
            async with AsyncClient(targets, resume_attempts=2) as client:
                stream = client.stream(voice, request_id="resumed")
                await stream.send(tokens[:80])  # the input stays open: the stream cannot end
                chunks = []
                async for chunk in stream:
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        await kill_serving()
                        await stream.send(tokens[80:])
                        await stream.end()
        assert stream.num_resumes == 1 and client.preferred == 1
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        offset = 0
        for c in chunks:
            assert c.sample_offset == offset
            offset += c.samples.size
        assert offset == total and chunks[-1].is_final
        out = np.concatenate([c.samples for c in chunks])
        np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    finally:
        await second.drain()
        await stack.stop()


def test_targets_and_resume_bounds_are_checked():
    assert split_targets(" a:1, b:2 ,") == ["a:1", "b:2"]
    assert split_targets(["a:1"]) == ["a:1"]
    with pytest.raises(ValueError, match="target"):
        split_targets(",")
    with pytest.raises(ValueError, match="resume_attempts"):
        AsyncClient("a:1", resume_attempts=-1)


def _request_writers() -> list[asyncio.Task]:
    """gRPC's tasks that write a call's request iterator, still running."""
    return [
        t
        for t in asyncio.all_tasks()
        if not t.done() and "_consume_request_iterator" in repr(t.get_coro())
    ]


async def test_soak_books_a_stream_resumed_across_a_gateway_kill(models):
    """bench/soak.py's accounting of a stream whose gateway is killed under it: the reference
    from its undisturbed run, one resume, no sample lost or duplicated, the audio within atol;
    and the same bookkeeping catches a dropped or repeated chunk and a failure at a fault."""
    stack = await start_stack(models)
    second = await stack.another_gateway()
    try:
        voice, tokens = stream_inputs(11, 20, 160)
        targets = [stack.target, f"127.0.0.1:{second.port}"]
        tally = Tally()
        await references(targets[1:], [(voice, tokens)], tally)
        assert tally.references[0].size == SAMPLES_PER_TOKEN * len(tokens)
        async with AsyncClient(targets, resume_attempts=2) as client:
            stream = client.stream(voice, request_id="soak-1")
            await stream.send(tokens[:60])  # the input stays open: the stream cannot end
            chunks = []
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 1:
                    gateway, stack.gateway = stack.gateway, None
                    await gateway.kill()
                    await stream.send(tokens[60:])
                    await stream.end()
            # the lost call's request writer ended with it, not left waiting on its queue
            await until(lambda: not _request_writers(), what="a request writer still waits")
        assert settle(tally, 0, chunks, len(tokens), stream.num_resumes, atol=1e-4)
        assert (tally.resumes, tally.resumed_streams, tally.outcomes["OK"]) == (1, 1, 1)
        assert (tally.samples_lost, tally.samples_duplicated, tally.audio_mismatch) == (0, 0, 0)
        assert 0 <= tally.max_abs_diff <= 1e-4
        assert failed(tally) == []

        # a chunk lost in the resume, then one delivered twice: both seen, both mismatches
        n = chunks[1].samples.size
        assert not settle(tally, 0, [chunks[0], *chunks[2:]], len(tokens), 1, atol=1e-4)
        assert (tally.samples_lost, tally.samples_duplicated) == (n, 0)
        assert not settle(tally, 0, [chunks[0], *chunks], len(tokens), 1, atol=1e-4)
        assert tally.samples_duplicated == chunks[0].samples.size
        assert tally.audio_mismatch == 2
        # a stream in flight at a gateway kill that then failed misses the bar
        tally.watched[7] = "kill_gateway"
        book_failure(tally, 7, "UNAVAILABLE", "gone")
        assert tally.admitted_failed == {"kill_gateway: UNAVAILABLE": 1}
        assert "streams in flight at a fault that failed: 1" in failed(tally)
    finally:
        await second.drain()
        await stack.stop()


async def test_a_stream_that_cannot_resume_ends_its_request_writer(models):
    stack = await start_stack(models)
    try:
        voice, tokens = stream_inputs(12, 20, 120)
        async with AsyncClient(stack.target, resume_attempts=0) as client:
            stream = client.stream(voice)
            await stream.send(tokens[:60])  # no end(): the writer waits for more input
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream:
                    gateway, stack.gateway = stack.gateway, None
                    await gateway.kill()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await until(lambda: not _request_writers(), what="a request writer still waits")
    finally:
        await stack.stop()


def test_client_channels_retry_a_restarted_gateway_within_a_second():
    """gRPC's default reconnect backoff grows to 120 s, and a channel in backoff fails a
    resumed stream at once without trying its gateway: the soak saw streams fail that way on a
    gateway restarted seconds before, while the other one drained."""
    from gateway.client import _open_channel

    seen = {}

    class Recorder:
        @staticmethod
        def insecure_channel(target, options):
            seen.update(options)
            return object()

    _open_channel(Recorder, "a:1", None, None, None)
    assert seen["grpc.max_reconnect_backoff_ms"] <= 1000
    assert seen["grpc.initial_reconnect_backoff_ms"] <= 1000


@pytest.mark.parametrize(
    ("code", "cancelled_here", "resumes"),
    [
        (grpc.StatusCode.UNAVAILABLE, False, True),
        (grpc.StatusCode.CANCELLED, False, True),  # the gateway shut down under the call
        (grpc.StatusCode.CANCELLED, True, False),  # the user's cancel(): never resumed
        (grpc.StatusCode.RESOURCE_EXHAUSTED, False, False),
        (grpc.StatusCode.INVALID_ARGUMENT, False, False),
    ],
)
def test_which_errors_resume(code, cancelled_here, resumes):
    from types import SimpleNamespace

    from gateway.client import _should_resume

    stream = SimpleNamespace(
        _cancelled=cancelled_here,
        num_resumes=0,
        _resume_attempts=3,
        _resume_within_s=30.0,
        _deadline=None,
    )
    md = grpc.aio.Metadata()
    exc = grpc.aio.AioRpcError(code, md, md, "details")
    assert _should_resume(stream, exc, None) is resumes
