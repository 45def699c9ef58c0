"""The whole stack on loopback (small presets, CPU): three real servers, clients over gRPC.

The oracle is the in-process reference pipeline (same models and schedule, upstream's stateless
re-decode of the whole mel each chunk)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from _reference import reference_synthesis
from _stack import start_stack, stream_inputs, until

from flow_service.model import load_flow
from gateway.client import AsyncClient, load_voice, make_sample, run_synthesis
from gateway.schedule import ScheduleConfig
from token2wav import SAMPLES_PER_TOKEN
from token2wav.tensors import make_voice
from token2wav.v1 import gateway_pb2, gateway_pb2_grpc
from vocoder_service.model import load_hift

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models():
    return load_flow(None, preset="small"), load_hift(None, preset="small")


def snr_db(out, ref):
    noise = np.sum((out.astype(np.float64) - ref) ** 2)
    return np.inf if noise == 0 else 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / noise)


async def run_stream(client, voice, tokens, seed, fmt="float32", **kw):
    """Feed tokens in random pieces at a random pace; collect chunks."""
    rng = np.random.default_rng(seed)
    stream = client.stream(voice, audio_format=fmt, **kw)

    async def feed():
        i = 0
        while i < len(tokens):
            n = int(rng.integers(1, 30))
            await stream.send(tokens[i : i + n])
            i += n
            # the pace under test: a client whose tokens trickle in, not a wait for the server
            await asyncio.sleep(float(rng.uniform(0, 0.03)))
        await stream.end()

    feeder = asyncio.ensure_future(feed())
    chunks = [c async for c in stream]
    await feeder
    return chunks


def check_exactly_once(chunks, n_tokens):
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    offset = 0
    for c in chunks:
        assert c.sample_offset == offset
        offset += c.samples.size
    assert offset == SAMPLES_PER_TOKEN * n_tokens
    assert chunks[-1].is_final and not any(c.is_final for c in chunks[:-1])


# The per-chunk path (the default) and block calls (--block-calls) give the same audio.
CALLS = pytest.mark.parametrize(
    "flags",
    [(), pytest.param(("--block-calls", "true"), marks=pytest.mark.slow)],
    ids=["chunks", "blocks"],
)


@CALLS
async def test_concurrent_streams_equal_reference(models, flags):
    stack = await start_stack(models, *flags)
    try:
        specs = [
            (40, 31),
            (75, 120),
            (12, 60),
            (30, 4),
            (25, 160),
            (7, 77),
            (50, 52),
            (18, 99),
            (33, 45),
        ]
        inputs = [stream_inputs(i, p, n) for i, (p, n) in enumerate(specs)]
        async with AsyncClient(stack.target) as client:
            results = await asyncio.gather(
                *[
                    run_stream(
                        client,
                        v,
                        t,
                        seed=i,
                        fmt="pcm16" if i == 8 else "float32",
                        request_id=f"stream-{i}",
                    )
                    for i, (v, t) in enumerate(inputs)
                ]
            )
        for i, ((v, t), chunks) in enumerate(zip(inputs, results)):
            check_exactly_once(chunks, len(t))
            ref_chunks = reference_synthesis(*models, v, t)
            assert [c.samples.size for c in chunks] == [r.size for r in ref_chunks]
            out, ref = np.concatenate([c.samples for c in chunks]), np.concatenate(ref_chunks)
            limit = 40 if i == 8 else 60  # PCM16 quantisation caps one stream's SNR
            assert snr_db(out, ref) >= limit, (i, snr_db(out, ref))
            assert all(c.timing.flow_batch_size >= 1 for c in chunks)
        assert not stack.sessions()  # every session finalized and closed
    finally:
        await stack.stop()


@CALLS
async def test_client_picked_schedules_equal_upstream_run_that_way(models, flags):
    """Through the served stack: `blocks` is upstream with a constant hop of 25, and a chunked
    final is upstream's finalize + streaming last call, each chunk for chunk."""
    blocks = gateway_pb2.ChunkSchedule(kind=gateway_pb2.SCHEDULE_KIND_BLOCKS)
    chunked = gateway_pb2.ChunkSchedule(final_attention=gateway_pb2.FINAL_ATTENTION_CHUNKED)
    cases = [
        (blocks, ScheduleConfig.blocks(), stream_inputs(3, 40, 140)),
        (chunked, ScheduleConfig(chunked_final=True), stream_inputs(4, 12, 190)),
    ]
    stack = await start_stack(models, *flags)
    try:
        async with AsyncClient(stack.target) as client:
            results = await asyncio.gather(
                *[
                    run_stream(client, v, t, seed=i, schedule=msg)
                    for i, (msg, _, (v, t)) in enumerate(cases)
                ]
            )
        for (_, config, (v, t)), chunks in zip(cases, results):
            check_exactly_once(chunks, len(t))
            ref_chunks = reference_synthesis(*models, v, t, config)
            assert [c.samples.size for c in chunks] == [r.size for r in ref_chunks]
            for c, r in zip(chunks, ref_chunks):
                assert snr_db(c.samples, r) >= 60, (config, c.seq, snr_db(c.samples, r))
    finally:
        await stack.stop()


@CALLS
async def test_out_of_order_flow_results_keep_audio(models, flags):
    returned = []  # token_offset of each flow call, in the order the calls came back
    two_back = asyncio.Event()

    async def around(request, submit):
        if request.token_offset == 0:
            await two_back.wait()  # chunk 0 comes back after two later chunks
        result = await submit()
        returned.append(request.token_offset)
        if len(returned) >= 2:
            two_back.set()
        return result

    stack = await start_stack(models, *flags, flow_around=around)
    try:
        # calls [0, 25), [25, 75), [75, 175), then the final one (with block calls: after them)
        voice, tokens = stream_inputs(42, 25, 240)
        async with AsyncClient(stack.target) as client:
            stream = client.stream(voice, audio_format="float32")
            await stream.send(tokens)
            await stream.end()
            chunks = [c async for c in stream]
        assert len(returned) >= 3 and returned.index(0) >= 2, returned
        check_exactly_once(chunks, len(tokens))
        ref = np.concatenate(reference_synthesis(*models, voice, tokens))
        assert snr_db(np.concatenate([c.samples for c in chunks]), ref) >= 60
    finally:
        await stack.stop()


async def test_client_cancel_drops_session_and_flow_calls(models):
    first_heard = asyncio.Event()  # the victim's first audio reached the client
    held = []  # the victim's later flow calls, in flight when it is cancelled

    async def around(request, submit):
        if request.cache_key.startswith("victim") and request.token_offset > 0:
            held.append(request.token_offset)
            await first_heard.wait()
        return await submit()

    stack = await start_stack(models, flow_around=around)
    try:
        voice, tokens = stream_inputs(5, 25, 400)
        other_voice, other_tokens = stream_inputs(6, 20, 90)
        async with AsyncClient(stack.target) as client:
            victim = client.stream(voice, audio_format="float32", request_id="victim")
            await victim.send(tokens[:300])  # several chunks in flight, no end yet
            other = asyncio.ensure_future(
                run_stream(client, other_voice, other_tokens, seed=1, request_id="other")
            )
            first = await victim.__aiter__().__anext__()
            assert first.seq == 0
            assert "victim" in stack.sessions()
            await until(lambda: held, what="no later victim call in flight")
            first_heard.set()  # they go on into the engine as the cancel travels down
            victim.cancel()
            await until(
                lambda: "victim" not in stack.sessions(),
                timeout=1.0,
                what="vocoder session outlived the cancel by 1 s",
            )
            chunks = await other
        check_exactly_once(chunks, len(other_tokens))
        ref = np.concatenate(reference_synthesis(*models, other_voice, other_tokens))
        assert snr_db(np.concatenate([c.samples for c in chunks]), ref) >= 60
        # the victim's flow calls leave the queue (cancelled), not run late
        await until(lambda: len(stack.engine.scheduler) == 0, timeout=0.2)
    finally:
        await stack.stop()


async def test_vocoder_session_lost_mid_stream_is_aborted(models):
    """A vocoder replica that loses a stream's session (restart, eviction) answers NOT_FOUND
    for the next seq; the stream cannot go on without that state, and the client is told
    ABORTED (retry the request), not INTERNAL."""

    session_lost = asyncio.Event()

    async def around(request, submit):
        if request.token_offset > 0:
            await session_lost.wait()  # the next mel reaches the vocoder after the loss
        return await submit()

    stack = await start_stack(models, "--vocoder-failovers", "0", flow_around=around)
    try:
        voice, tokens = stream_inputs(7, 25, 200)
        async with AsyncClient(stack.target) as client:
            stream = client.stream(voice, audio_format="float32", request_id="lost")
            await stream.send(tokens)
            await stream.end()
            chunks = stream.__aiter__()
            assert (await chunks.__anext__()).seq == 0
            manager = stack.vocoder_server.service.manager
            (key,) = [k for k in manager._active if k.startswith("lost:")]
            assert manager.cancel(key)  # what a restarted replica would have lost
            session_lost.set()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in chunks:
                    pass
        assert info.value.code() == grpc.StatusCode.ABORTED
        # the second form when grpc.aio's client hid the vocoder's NOT_FOUND behind a failed write
        assert any(
            text in info.value.details()
            for text in ("lost this stream's session", "ended this stream's session call early")
        )
    finally:
        await stack.stop()


async def _call(target, messages, timeout=20):
    """Status of a stream that sends `messages` and half-closes. The sync client on purpose:
    grpc.aio's client can report "Internal error from Core" instead of the server's status when
    the server ends the call while the client is still writing (a client-side race)."""

    def call():
        with grpc.insecure_channel(target) as ch:
            with pytest.raises(grpc.RpcError) as info:
                for _ in gateway_pb2_grpc.GatewayStub(ch).Synthesize(
                    iter(messages), timeout=timeout
                ):
                    pass
            return info.value.code(), info.value.details()

    return await asyncio.to_thread(call)


def cfg_msg(voice=None, voice_id=""):
    cfg = gateway_pb2.StreamConfig(audio_format=gateway_pb2.AUDIO_FORMAT_PCM16)
    if voice_id:
        cfg.voice_id = voice_id
    else:
        cfg.inline_voice.CopyFrom(voice.to_proto())
    return gateway_pb2.SynthesizeRequest(config=cfg)


def tok(ids):
    return gateway_pb2.SynthesizeRequest(tokens=gateway_pb2.TokenChunk(tokens=ids))


END = gateway_pb2.SynthesizeRequest(end=gateway_pb2.EndOfInput())
IA = grpc.StatusCode.INVALID_ARGUMENT


async def test_malformed_client_input(models):
    stack = await start_stack(models, "--max-message-mb", "1")
    try:
        voice, tokens = stream_inputs(3, 10, 40)
        t = stack.target
        ids = [int(x) for x in tokens]
        assert await _call(t, []) == (IA, "config: empty stream: send a StreamConfig first")
        code, msg = await _call(t, [tok(ids)])
        assert (code, msg.split(":")[0]) == (IA, "config")
        code, msg = await _call(t, [cfg_msg(voice), tok(ids), END, tok(ids)])
        assert code == IA and "after EndOfInput" in msg, msg
        code, msg = await _call(t, [cfg_msg(voice), tok([1, 2, 6561])])
        assert code == IA and msg.startswith("tokens.tokens[2]"), msg
        code, msg = await _call(t, [cfg_msg(voice), END])
        assert code == IA and "without any token" in msg, msg
        code, msg = await _call(t, [cfg_msg(voice), tok(ids)])  # half-close, no EndOfInput
        assert code == IA and msg.startswith("end:"), msg
        code, msg = await _call(t, [cfg_msg(voice_id="v1-" + "f" * 32), tok(ids), END])
        assert code == grpc.StatusCode.NOT_FOUND, msg
        code, _ = await _call(t, [cfg_msg(voice), tok([5000] * 600_000), END])  # 1.2 MB > 1 MiB
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        bad_voice = make_voice(voice.prompt_token, voice.prompt_feat, voice.embedding).to_proto()
        bad_voice.prompt_feat.shape[0] = 3
        cfg = gateway_pb2.StreamConfig(inline_voice=bad_voice)
        code, msg = await _call(t, [gateway_pb2.SynthesizeRequest(config=cfg), tok(ids), END])
        assert code == IA and msg.startswith("config.inline_voice.prompt_feat")
        # After all that, a good stream still works, and a registered voice is usable by id.
        async with AsyncClient(t) as client:
            vid = await client.register_voice(voice)
            chunks = await run_stream(client, vid, tokens, seed=0)
            check_exactly_once(chunks, len(tokens))
            await client.delete_voice(vid)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.delete_voice(vid)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await stack.stop()


def test_cli_synthesize_writes_wav(models, tmp_path):
    async def main():
        stack = await start_stack(models)
        try:
            voice_path, tokens_path = make_sample(tmp_path, prompt_tokens=20, tokens=60)
            voice, tokens = load_voice(voice_path), np.load(tokens_path)
            return await asyncio.to_thread(
                run_synthesis,
                stack.target,
                voice,
                tokens,
                str(tmp_path / "out.wav"),
                0.0,
                "pcm16",
                False,
            )
        finally:
            await stack.stop()

    r = asyncio.run(main())
    import wave

    with wave.open(str(tmp_path / "out.wav")) as w:
        assert w.getframerate() == 24000 and w.getnframes() == 60 * SAMPLES_PER_TOKEN
    assert r["samples"] == 60 * SAMPLES_PER_TOKEN and r["first_chunk_ms"] > 0


async def test_reused_request_id_gets_its_own_audio(models):
    """The vocoder keeps finished sessions for retries; a new stream under an old client
    request id must still get its own audio, not the cached audio of the old one."""
    stack = await start_stack(models)
    try:
        async with AsyncClient(stack.target) as client:
            for seed in (21, 22):
                voice, tokens = stream_inputs(seed, 20, 50)
                chunks = await run_stream(client, voice, tokens, seed=seed, request_id="same-id")
                check_exactly_once(chunks, len(tokens))
                ref = np.concatenate(reference_synthesis(*models, voice, tokens))
                assert snr_db(np.concatenate([c.samples for c in chunks]), ref) >= 60
    finally:
        await stack.stop()


def test_pcm16_conversion_is_the_documented_rounding():
    """The client's PCM16: round(x * 32767) half to even, clipped to int16, exactly as the
    plain numpy formula says (the gateway computes it in place); float32 passes through byte
    for byte; a non-finite sample is refused naming the field."""
    from gateway.pipeline import to_client_audio
    from token2wav.errors import InvalidArgument
    from token2wav.tensors import encode

    pcm16, f32 = gateway_pb2.AUDIO_FORMAT_PCM16, gateway_pb2.AUDIO_FORMAT_FLOAT32
    edges = np.array([0.5, -0.5, 1.0, -1.0, 1.5, -1.5, 0.0, 1e-9, 1e30], np.float32)
    got = np.frombuffer(to_client_audio(encode(edges), pcm16), "<i2")
    assert got.tolist() == [16384, -16384, 32767, -32767, 32767, -32768, 0, 0, 32767]
    x = np.random.default_rng(0).normal(0, 0.7, 50_000).astype(np.float32)
    want = np.clip(np.round(x * 32767.0), -32768, 32767).astype("<i2").tobytes()
    assert to_client_audio(encode(x), pcm16) == want
    assert to_client_audio(encode(x), f32) == x.astype("<f4").tobytes()
    with pytest.raises(InvalidArgument, match="audio: non-finite value at flat index 1"):
        to_client_audio(encode(np.array([0.0, np.nan], np.float32)), pcm16)
