"""The WebSocket endpoint (gateway/websocket.py) in front of the real stack on loopback: the
same audio as gRPC, tokens as JSON or int32, errors as close codes, a closed socket cancelling
its stream, bearer tokens, the demo page; and the demo page in headless Chromium, which must
receive and play every sample."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from _stack import start_stack, stream_inputs, until
from test_audio_format import snr_db
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from flow_service.model import load_flow
from gateway.client import AsyncClient
from gateway.config import GatewayConfig, build_parser
from gateway.websocket import HEADER
from token2wav import SAMPLES_PER_TOKEN
from vocoder_service.model import load_hift

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models():
    return load_flow(None, preset="small"), load_hift(None, preset="small")


def voice_json(voice) -> dict:
    return {
        "prompt_token": voice.prompt_token.tolist(),
        "prompt_feat": voice.prompt_feat.tolist(),
        "embedding": voice.embedding.tolist(),
    }


async def ws_stream(url, config: dict, tokens, *, headers=None) -> tuple[list, int, str]:
    """(chunks as (seq, offset, n, rate, final, audio), close code, close reason)."""
    chunks = []
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        await ws.send(json.dumps(config))
        half = len(tokens) // 2
        await ws.send(json.dumps([int(t) for t in tokens[:half]]))
        await ws.send(np.asarray(tokens[half:], "<i4").tobytes())
        await ws.send(json.dumps({"end": True}))
        try:
            async for message in ws:
                seq, offset, n, rate, flags = HEADER.unpack_from(message)
                chunks.append((seq, offset, n, rate, bool(flags & 1), message[HEADER.size :]))
        except ConnectionClosed:
            pass
        return chunks, ws.close_code, ws.close_reason


@pytest.fixture
async def bridged(models):
    stack = await start_stack(models, "--websocket-port", "0")
    bridge = stack.gateway.websocket
    try:
        yield stack, bridge, f"ws://127.0.0.1:{bridge.port}/"
    finally:
        await stack.stop()


async def test_websocket_streams_what_grpc_streams(bridged):
    stack, bridge, url = bridged
    voice, tokens = stream_inputs(3, 20, 50)
    async with AsyncClient(stack.target) as client:
        stream = client.stream(voice, audio_format="float32")
        await stream.send(tokens)
        await stream.end()
        ref = np.concatenate([c.samples for c in [c async for c in stream]])
    config = {"voice": voice_json(voice), "audio_format": "pcm16", "request_id": "ws-1"}
    chunks, code, _ = await ws_stream(url, config, tokens)
    assert code == 1000
    assert [c[0] for c in chunks] == list(range(len(chunks)))
    offsets = np.cumsum([0] + [c[2] for c in chunks])
    assert [c[1] for c in chunks] == offsets[:-1].tolist()
    assert offsets[-1] == 50 * SAMPLES_PER_TOKEN and {c[3] for c in chunks} == {24000}
    assert [c[4] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    got = np.frombuffer(b"".join(c[5] for c in chunks), "<i2") / 32768
    assert snr_db(ref, got) > 50
    # A rate and a format, by name, as gRPC has them.
    config = {"voice": voice_json(voice), "audio_format": "mulaw", "sample_rate": 8000}
    config["start_buffer_ms"] = 0  # StreamConfig's, passed on (the servicer bounds it)
    chunks, code, _ = await ws_stream(url, config, tokens)
    assert code == 1000 and sum(c[2] for c in chunks) == 50 * 320
    assert sum(len(c[5]) for c in chunks) == 50 * 320  # one byte a sample
    assert not stack.sessions()


async def test_websocket_errors_are_close_codes_naming_the_field(bridged):
    stack, bridge, url = bridged
    voice, tokens = stream_inputs(4, 20, 30)
    cases = [
        ({"voice": voice_json(voice), "colour": "blue"}, tokens, 4003, "config.colour"),
        ({"voice": voice_json(voice), "audio_format": "aac"}, tokens, 4003, "audio_format"),
        ({"voice": voice_json(voice), "audio_format": "alaw"}, tokens, 4003, "config.sample_rate"),
        ({"voice": voice_json(voice), "start_buffer_ms": -1}, tokens, 4003, "start_buffer_ms"),
        ({"voice": voice_json(voice), "start_buffer_ms": 5000}, tokens, 4003, "start_buffer_ms"),
        ({"voice_id": "v1-" + "0" * 32}, tokens, 4005, "voice"),
        ({"voice": voice_json(voice)}, [1, 2, 7000], 4003, "tokens"),
    ]
    for config, toks, want_code, words in cases:
        _, code, reason = await ws_stream(url, config, toks)
        assert (code, words in reason) == (want_code, True), (config.keys(), code, reason)
        assert "\n" not in reason and len(reason.encode()) <= 123
    # Not JSON where tokens belong: refused by the bridge itself, the stream cancelled.
    async with connect(url) as ws:
        await ws.send(json.dumps({"voice": voice_json(voice)}))
        await ws.send("[1, 2.5]")
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert ws.close_code == 4003 and "tokens" in ws.close_reason
    await until(lambda: stack.gateway_server_streams() == 0, what="streams closed")


async def test_closing_the_socket_cancels_the_stream(bridged):
    stack, bridge, url = bridged
    voice, tokens = stream_inputs(5, 20, 200)
    async with connect(url) as ws:
        await ws.send(json.dumps({"voice": voice_json(voice), "request_id": "leaver"}))
        await ws.send(json.dumps([int(t) for t in tokens[:60]]))  # no end: the stream stays open
        await ws.recv()  # the first chunk: the stream is running
        assert stack.gateway_server_streams() == 1
    await until(lambda: stack.gateway_server_streams() == 0, what="stream cancelled")
    await until(lambda: not stack.sessions(), what="vocoder session dropped")


async def test_bearer_tokens_as_grpc(models, tmp_path):
    secret = "s3cret-token-0123456789"
    (tmp_path / "tokens").write_text(f"alice {secret}\n")
    stack = await start_stack(
        models, "--auth-tokens", str(tmp_path / "tokens"), "--websocket-port", "0"
    )
    url = f"ws://127.0.0.1:{stack.gateway.websocket.port}/"
    try:
        voice, tokens = stream_inputs(6, 20, 25)
        config = {"voice": voice_json(voice)}
        _, code, reason = await ws_stream(url, config, tokens)
        assert code == 4016, reason  # UNAUTHENTICATED
        chunks, code, _ = await ws_stream(url, {**config, "token": secret}, tokens)
        assert code == 1000 and sum(c[2] for c in chunks) == 25 * SAMPLES_PER_TOKEN
        headers = {"Authorization": f"Bearer {secret}"}
        chunks, code, _ = await ws_stream(url, config, tokens, headers=headers)
        assert code == 1000 and sum(c[2] for c in chunks) == 25 * SAMPLES_PER_TOKEN
    finally:
        await stack.stop()


async def test_demo_page_and_sample_are_served(bridged):
    _, bridge, _ = bridged
    base = f"http://127.0.0.1:{bridge.port}"
    page = await asyncio.to_thread(lambda: urllib.request.urlopen(base + "/").read().decode())
    assert "new WebSocket" in page and "AudioContext" in page
    raw = await asyncio.to_thread(lambda: urllib.request.urlopen(base + "/sample.json").read())
    sample = json.loads(raw)
    assert len(sample["tokens"]) == 250 and len(sample["voice"]["prompt_token"]) == 75
    with pytest.raises(urllib.error.HTTPError) as info:
        await asyncio.to_thread(urllib.request.urlopen, base + "/nothing")
    assert info.value.code == 404
    info.value.close()


# ---- the demo page in headless Chromium ------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


async def devtools_eval(ws_url: str, page_url: str, expression: str, timeout: float) -> dict:
    """Open `page_url` in a new tab over the DevTools protocol; poll `expression` (JSON text)
    until it says done or `timeout` passes; its last value."""
    async with connect(ws_url, max_size=None) as ws:
        ids = iter(range(1, 10**6))

        async def call(method, session=None, **params):
            n = next(ids)
            msg = {"id": n, "method": method, "params": params}
            if session:
                msg["sessionId"] = session
            await ws.send(json.dumps(msg))
            while True:
                reply = json.loads(await ws.recv())
                if reply.get("id") == n:
                    assert "error" not in reply, reply
                    return reply["result"]

        target = await call("Target.createTarget", url=page_url)
        session = (await call("Target.attachToTarget", targetId=target["targetId"], flatten=True))[
            "sessionId"
        ]
        value: dict = {}
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            result = await call("Runtime.evaluate", session, expression=expression)
            text = result["result"].get("value")
            value = json.loads(text) if text else {}
            if value.get("done"):
                break
            await asyncio.sleep(0.2)
        return value


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
async def test_demo_page_plays_every_sample_in_chromium(bridged):
    _, bridge, _ = bridged
    n_tokens = 50  # 2 s of audio: the page plays it in real time
    page = f"http://127.0.0.1:{bridge.port}/?autoplay&tokens={n_tokens}"
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--autoplay-policy=no-user-gesture-required",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            await until(port_file.exists, timeout=30, what="chromium's DevTools port")
            await until(lambda: len(port_file.read_text().splitlines()) == 2, timeout=10)
            port, path = port_file.read_text().splitlines()
            state = await devtools_eval(
                f"ws://127.0.0.1:{port}{path}",
                page,
                "JSON.stringify(window.t2w || {})",
                timeout=60,
            )
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
    want = n_tokens * SAMPLES_PER_TOKEN
    assert state.get("done"), state
    assert state["error"] is None and state["closeCode"] == 1000, state
    assert state["expected"] == state["received"] == state["played"] == want, state
    assert state["chunks"] >= 2 and state["pending"] == 0, state


def test_websocket_flag_refuses_tls():
    args = build_parser().parse_args(
        ["--websocket-port", "0", "--tls-cert", "c.pem", "--tls-key", "k.pem"]
    )
    with pytest.raises(ValueError, match="--websocket-port: not with --tls-cert"):
        GatewayConfig.from_args(args)
    assert GatewayConfig.from_args(build_parser().parse_args([])).websocket_port is None
