"""The stack with TLS and authentication on: TLS on every listener, mutual TLS between the
gateway and the internal services, bearer tokens on the gateway, vocoder control calls only
from the gateway's certificate. A throwaway CA is made here with `cryptography`."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from _stack import start_stack, stream_inputs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from flow_service.model import load_flow
from gateway.client import AsyncClient
from token2wav import SAMPLES_PER_TOKEN
from token2wav.security import channel_credentials, load_tokens
from token2wav.v1 import vocoder_pb2, vocoder_pb2_grpc
from vocoder_service.model import load_hift

torch.set_num_threads(1)
TOKENS = {"alice": "alice-secret-0123456789", "bob": "bob-secret-0123456789ab"}
REGISTER_ONLY = "carol-secret-0123456789"


@pytest.fixture(scope="module")
def models():
    return load_flow(None, preset="small"), load_hift(None, preset="small")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert, key) -> tuple[str, str]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(path.with_suffix(".crt")), str(path.with_suffix(".key"))


def make_pki(root: Path) -> dict[str, tuple[str, str]]:
    """A CA and leaf certificates: 'server' (127.0.0.1, localhost), 'gateway' and 'intruder'
    (client certificates signed by the same CA)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("t2w test CA"))
        .issuer_name(_name("t2w test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    out = {"ca": _write(root / "ca", ca, ca_key)}
    for cn in ("server", "gateway", "intruder"):
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.DNSName(cn)]
        if cn == "server":
            sans += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        out[cn] = _write(root / cn, cert, key)
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    certs = make_pki(root)
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
