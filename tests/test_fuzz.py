"""Property-based fuzzing (hypothesis) of every request message of the three services, field by
field and as raw bytes: every answer is OK or a documented refusal (never INTERNAL or UNKNOWN),
and the services keep serving good streams afterwards.

The stack runs on its own event loop in a background thread; the fuzzing calls are synchronous.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
import torch
from _stack import start_stack, stream_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flow_service.model import load_flow
from gateway.client import Client
from token2wav import SAMPLES_PER_TOKEN
from token2wav.v1 import common_pb2, flow_pb2, gateway_pb2, vocoder_pb2
from vocoder_service.model import load_hift

torch.set_num_threads(1)
SC = grpc.StatusCode
DOCUMENTED = {
    SC.OK,
    SC.INVALID_ARGUMENT,
    SC.NOT_FOUND,
    SC.ABORTED,
    SC.RESOURCE_EXHAUSTED,
    SC.DEADLINE_EXCEEDED,
    SC.UNAVAILABLE,
}
FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def stack():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    models = (load_flow(None, preset="small"), load_hift(None, preset="small"))
    s = run(start_stack(models, "--first-tokens-timeout", "2", "--input-idle-timeout", "2"))
    channels = {
        "flow": grpc.insecure_channel(f"127.0.0.1:{s.flow_server.port}"),
        "vocoder": grpc.insecure_channel(f"127.0.0.1:{s.vocoder_ports[0]}"),
        "gateway": grpc.insecure_channel(s.target),
    }
    yield s, channels
    for ch in channels.values():
        ch.close()
    try:
        # the services survived it all: a good stream still gets all its audio
        voice, tokens = stream_inputs(99, 10, 40)
        with Client(s.target) as client:
            audio = client.synthesize(voice, tokens, timeout=60)
        assert audio.size == 40 * SAMPLES_PER_TOKEN
    finally:
        run(s.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def status(call) -> SC:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return SC.OK


def unary(channel, method: str, request: bytes) -> SC:
    return status(lambda: channel.unary_unary(method)(request, timeout=20))


def streaming(channel, method: str, requests: list[bytes]) -> SC:
    return status(lambda: list(channel.stream_stream(method)(iter(requests), timeout=20)))


# -- strategies ------------------------------------------------------------------------------

ids = st.one_of(
    st.text(max_size=140),
    st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True),
)
ELEMENT_BYTES = {1: 4, 2: 4, 3: 8, 4: 2}


@st.composite
def tensors(draw, max_elems=2000):
    """Random tensors, half of them self-consistent (data length matches shape and dtype)."""
    dtype = draw(st.integers(0, 6))
    shape = draw(st.lists(st.integers(-2, 120), max_size=3))
    if draw(st.booleans()) and dtype in ELEMENT_BYTES and all(d >= 0 for d in shape):
        n = int(np.prod(shape)) if shape else 1
        if n <= max_elems:
            if dtype == 1:
                values = draw(st.lists(st.floats(width=32), min_size=n, max_size=n))
                data = np.asarray(values, "<f4").tobytes()
            else:
                data = draw(st.binary(min_size=n * ELEMENT_BYTES[dtype], max_size=n * 8))
                data = data[: n * ELEMENT_BYTES[dtype]]
            return common_pb2.Tensor(dtype=dtype, shape=shape, data=data)
    return common_pb2.Tensor(dtype=dtype, shape=shape, data=draw(st.binary(max_size=4000)))


voices = st.builds(
    common_pb2.Voice, prompt_token=tensors(), prompt_feat=tensors(), embedding=tensors()
)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@st.composite
def generate_requests(draw):
    req = flow_pb2.GenerateRequest(
        request_id=draw(ids),
        seq=draw(u64),
        tokens=draw(tensors(max_elems=60)),
        token_offset=draw(u32),
        finalize=draw(st.booleans()),
        streaming=draw(st.booleans()),
    )
    which = draw(st.sampled_from(["inline", "id", "none"]))
    if which == "inline":
        req.inline_voice.CopyFrom(draw(voices))
    elif which == "id":
        req.voice_id = draw(ids)
    return req


vocoder_chunks = st.builds(
    vocoder_pb2.VocoderChunk,
    request_id=ids,
    seq=st.integers(0, 5) | u64,
    mel=tensors(),
    finalize=st.booleans(),
)


@st.composite
def synthesize_streams(draw):
    msgs = []
    if draw(st.booleans()):
        cfg = gateway_pb2.StreamConfig(
            request_id=draw(ids),
            audio_format=draw(st.integers(0, 5)),
            schedule=gateway_pb2.ChunkSchedule(
                first_hop_tokens=draw(st.integers(0, 1100)),
                max_hop_tokens=draw(st.integers(0, 1100)),
                hop_scale=draw(st.integers(0, 10)),
                disable_prompt_pad=draw(st.booleans()),
            ),
        )
        if draw(st.booleans()):
            cfg.inline_voice.CopyFrom(draw(voices))
        else:
            cfg.voice_id = draw(ids)
        msgs.append(gateway_pb2.SynthesizeRequest(config=cfg))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["tokens", "end", "config", "empty"]))
        if kind == "tokens":
            toks = draw(st.lists(st.integers(0, 7000) | u32, max_size=40))
            msgs.append(gateway_pb2.SynthesizeRequest(tokens=gateway_pb2.TokenChunk(tokens=toks)))
        elif kind == "end":
            msgs.append(gateway_pb2.SynthesizeRequest(end=gateway_pb2.EndOfInput()))
        elif kind == "config":
            msgs.append(gateway_pb2.SynthesizeRequest(config=gateway_pb2.StreamConfig()))
        else:
            msgs.append(gateway_pb2.SynthesizeRequest())
    return [m.SerializeToString() for m in msgs]


# -- properties ------------------------------------------------------------------------------


@FUZZ
@given(req=generate_requests())
def test_flow_generate_fields(stack, req):
    code = unary(stack[1]["flow"], "/token2wav.v1.Flow/Generate", req.SerializeToString())
    assert code in DOCUMENTED, code


@FUZZ
@given(chunks=st.lists(vocoder_chunks, max_size=4))
def test_vocoder_session_fields(stack, chunks):
    msgs = [c.SerializeToString() for c in chunks]
    code = streaming(stack[1]["vocoder"], "/token2wav.v1.Vocoder/Session", msgs)
    assert code in DOCUMENTED, code


@FUZZ
@given(
    method=st.sampled_from(["CancelSession", "ExportSession", "ImportSession"]),
    rid=ids,
    state=st.binary(max_size=3000),
    seq=u64,
    remove=st.booleans(),
)
def test_vocoder_control_fields(stack, method, rid, state, seq, remove):
    msg = {
        "CancelSession": vocoder_pb2.CancelSessionRequest(request_id=rid),
        "ExportSession": vocoder_pb2.ExportSessionRequest(request_id=rid, remove=remove),
        "ImportSession": vocoder_pb2.ImportSessionRequest(
            request_id=rid, state=state, next_seq=seq
        ),
    }[method]
    code = unary(stack[1]["vocoder"], f"/token2wav.v1.Vocoder/{method}", msg.SerializeToString())
    assert code in DOCUMENTED, code


@FUZZ
@given(msgs=synthesize_streams())
def test_gateway_synthesize_fields(stack, msgs):
    code = streaming(stack[1]["gateway"], "/token2wav.v1.Gateway/Synthesize", msgs)
    assert code in DOCUMENTED, code


@FUZZ
@given(voice=voices, delete_id=ids)
def test_gateway_voice_fields(stack, voice, delete_id):
    ch = stack[1]["gateway"]
    reg = gateway_pb2.RegisterVoiceRequest(voice=voice).SerializeToString()
    assert unary(ch, "/token2wav.v1.Gateway/RegisterVoice", reg) in DOCUMENTED
    dele = gateway_pb2.DeleteVoiceRequest(voice_id=delete_id).SerializeToString()
    assert unary(ch, "/token2wav.v1.Gateway/DeleteVoice", dele) in DOCUMENTED


METHODS = [
    ("flow", "/token2wav.v1.Flow/Generate", False),
    ("vocoder", "/token2wav.v1.Vocoder/Session", True),
    ("vocoder", "/token2wav.v1.Vocoder/CancelSession", False),
    ("vocoder", "/token2wav.v1.Vocoder/ExportSession", False),
    ("vocoder", "/token2wav.v1.Vocoder/ImportSession", False),
    ("gateway", "/token2wav.v1.Gateway/Synthesize", True),
    ("gateway", "/token2wav.v1.Gateway/RegisterVoice", False),
    ("gateway", "/token2wav.v1.Gateway/DeleteVoice", False),
]


@FUZZ
@given(target=st.sampled_from(METHODS), data=st.lists(st.binary(max_size=300), max_size=3))
def test_raw_bytes(stack, target, data):
    service, method, is_stream = target
    ch = stack[1][service]
    if is_stream:
        code = streaming(ch, method, data)
    else:
        code = unary(ch, method, data[0] if data else b"")
    assert code in DOCUMENTED, (method, code)
