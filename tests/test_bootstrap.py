"""Server bootstrap: health follows warm-up and drain, SIGTERM drains in-flight streams while new
calls get UNAVAILABLE, metrics are served, and errors map to status codes at one place."""

import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from _stack import wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from token2wav.errors import InvalidArgument, NotFound
from token2wav.server import GrpcServer, ServerOptions
from token2wav.service import Service

HERE = Path(__file__).resolve().parent


def _health(channel, service=""):
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


def test_health_warmup_sigterm_drain_and_metrics():
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "_bootstrap_server.py"),
            "--drain-delay",
            "0.6",
            "--grace",
            "10",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )

    def tell(word: str) -> None:  # the stand-in's warm-up and held messages wait for these
        proc.stdin.write(word + "\n")
        proc.stdin.flush()

    try:
        line = proc.stdout.readline().split()
        assert line[0] == "PORT", line
        port, metrics_port = int(line[1]), int(line[2])
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        NOT, SERVING = (
            health_pb2.HealthCheckResponse.NOT_SERVING,
            health_pb2.HealthCheckResponse.SERVING,
        )
        # Listening but still warming up: NOT_SERVING, for the whole server and the service.
        assert _health(channel) == NOT
        assert _health(channel, "test.Slow") == NOT
        tell("warm")
        wait_until(lambda: _health(channel) == SERVING, 10, "never SERVING after warm-up")
        assert _health(channel, "test.Slow") == SERVING

        count = channel.unary_stream("/test.Slow/Count")
        list(count(b"1,1", timeout=5))  # one finished call, so the counter has a sample
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
            .read()
            .decode()
        )
        assert 't2w_grpc_calls_total{code="OK",method="/test.Slow/Count"} 1.0' in body

        received, errors = [], []

        def consume():
            try:
                for msg in count(b"12,2", timeout=20):  # 2 now, 10 once released
                    received.append(msg)
            except grpc.RpcError as exc:  # pragma: no cover - the assertion below reports it
                errors.append(exc)

        reader = threading.Thread(target=consume)
        reader.start()
        wait_until(lambda: len(received) == 2, 10, "the stream did not send its first two")
        proc.send_signal(signal.SIGTERM)
        # Drain delay: still accepting, but health says NOT_SERVING.
        wait_until(lambda: _health(channel) == NOT, 0.5, "still SERVING 0.5 s after SIGTERM")
        # After the delay the listener refuses new calls while the old stream goes on: short
        # calls (answered at once while it still accepts) until one is refused.
        refused = []

        def probe_refused():
            try:
                list(count(b"1,1", timeout=5))
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED:
                    # accepted in the instant the listener closed, then cut: neither served nor
                    # refused (the sleep this loop replaced never sampled that instant); probe on
                    return False
                refused.append(exc.code())
                return True
            return False

        wait_until(probe_refused, 10, "new calls still accepted 10 s after SIGTERM")
        assert refused == [grpc.StatusCode.UNAVAILABLE]
        assert len(received) == 2, "the in-flight stream should still be running"
        tell("release")  # it finishes during the drain
        reader.join(15)
        assert not errors, errors
        assert [int(m) for m in received] == list(range(12))
        assert proc.wait(15) == 0
        assert "EXITED" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_error_interceptor_maps_typed_errors():
    async def bad_arg(request, context):
        raise InvalidArgument("voice.embedding", "want 192 values")

    async def missing(request, context):
        raise NotFound("voice v1-abc is not on this replica")

    async def field_error(request, context):
        class ModelInputError(ValueError):
            field = "tokens"

        raise ModelInputError("tokens[3]: id 9999 outside 0..6560")

    async def bug(request, context):
        raise RuntimeError("secret stack detail")

    class E(Service):
        grpc_services = ("test.E",)

        def register(self, server):
            server.add_generic_rpc_handlers(
                (
                    grpc.method_handlers_generic_handler(
                        "test.E",
                        {
                            name: grpc.unary_unary_rpc_method_handler(fn)
                            for name, fn in {
                                "Bad": bad_arg,
                                "Missing": missing,
                                "Field": field_error,
                                "Bug": bug,
                            }.items()
                        },
                    ),
                )
            )

    srv = GrpcServer(ServerOptions(port=0), E(None))
    port = await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:

            async def call(name):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await ch.unary_unary(f"/test.E/{name}")(b"", timeout=5)
                return info.value.code(), info.value.details()

            assert await call("Bad") == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "voice.embedding: want 192 values",
            )
            assert (await call("Missing"))[0] == grpc.StatusCode.NOT_FOUND
            assert await call("Field") == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "tokens[3]: id 9999 outside 0..6560",
            )
            code, details = await call("Bug")
            assert code == grpc.StatusCode.INTERNAL and "secret" not in details
    finally:
        await srv.drain()


def test_help_documents_env_mirror(monkeypatch):
    from token2wav.cli import EnvParser, add_server_flags

    monkeypatch.setenv("DEMO_PORT", "6000")
    monkeypatch.setenv("DEMO_DRAIN_DELAY", "2.5")
    parser = EnvParser("DEMO", prog="demo")
    add_server_flags(parser, port=5000, metrics_port=9000)
    args = parser.parse_args([])
    assert args.port == 6000 and args.drain_delay == 2.5  # env var sets the default
    assert parser.parse_args(["--port", "7000"]).port == 7000  # the flag wins
    text = " ".join(parser.format_help().split())  # argparse wraps lines
    for flag in (
        "--host",
        "--port",
        "--metrics-port",
        "--grace-period",
        "--drain-delay",
        "--max-message-mb",
        "--log-level",
    ):
        assert flag in text
        assert f"[env {parser.env_name(flag)}]" in text


def test_bad_env_value_is_reported(monkeypatch, capsys):
    from token2wav.cli import EnvParser

    monkeypatch.setenv("DEMO_PORT", "not-a-number")
    parser = EnvParser("DEMO", prog="demo")
    with pytest.raises(SystemExit):
        parser.flag("--port", type=int, default=1, help="p")
    assert "DEMO_PORT" in capsys.readouterr().err
