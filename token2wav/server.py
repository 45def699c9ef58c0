"""The gRPC server bootstrap shared by gateway, flow_service and vocoder_service.

`GrpcServer` owns the grpc.aio server, `grpc.health.v1` (NOT_SERVING until the service says it
is warm, NOT_SERVING again on drain; optionally also alone on a plaintext port), reflection
(off by default), the Prometheus endpoint, the error interceptor, and SIGTERM/SIGINT handling: health -> NOT_SERVING, optional drain delay, then
`stop(grace)` so in-flight streams finish while new calls get UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from token2wav import tracing
from token2wav.errors import BadMessage, StartupError, status_for
from token2wav.faults import EXIT_DEVICE_LOST
from token2wav.security import server_credentials

logger = logging.getLogger(__name__)

# The stream a log line belongs to; servicers set it at the top of each call.
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

RPC_CALLS = Counter(
    "t2w_grpc_calls_total", "Finished RPCs by method and status code", ["method", "code"]
)
RPC_SECONDS = Histogram(
    "t2w_grpc_call_seconds",
    "RPC duration by method",
    ["method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)


def _cuda_bytes(stat: str) -> float:
    # Read at scrape time on the metrics thread; never the first CUDA call of the process
    # (that would create a context on the wrong thread), and no torch import in the gateway.
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0.0
    return float(sum(getattr(torch.cuda, stat)(i) for i in range(torch.cuda.device_count())))


GPU_ALLOCATED = Gauge(
    "t2w_gpu_memory_allocated_bytes", "CUDA memory held by tensors, all devices (0: no CUDA)"
)
GPU_ALLOCATED.set_function(lambda: _cuda_bytes("memory_allocated"))
GPU_RESERVED = Gauge(
    "t2w_gpu_memory_reserved_bytes",
    "CUDA memory reserved by the caching allocator, all devices (0: no CUDA)",
)
GPU_RESERVED.set_function(lambda: _cuda_bytes("memory_reserved"))


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (tests)
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port (tests)
    grace_period: float = 30.0  # s for in-flight calls after SIGTERM
    drain_delay: float = 0.0  # s of NOT_SERVING before the listener closes
    max_message_mb: int = 64
    tls_cert: str | None = None  # PEM files; both set: TLS on the gRPC listener
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set: mutual TLS, clients need a cert signed by this CA
    reflection: bool = False  # on: behind the same interceptors (tokens) as the API
    interceptors: tuple = ()  # e.g. authentication; they run inside the error mapping
    # grpc.health.v1 alone, plaintext, on its own port: probes that hold no client key.
    # None: none; 0: any free port (tests).
    health_port: int | None = None

    def __post_init__(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")

    @classmethod
    def from_args(cls, args) -> ServerOptions:
        # On the command line 0 means "off", the convention of most exporters.
        return cls(
            args.host,
            args.port,
            args.metrics_port or None,
            args.grace_period,
            args.drain_delay,
            args.max_message_mb,
            getattr(args, "tls_cert", None),
            getattr(args, "tls_key", None),
            getattr(args, "tls_client_ca", None),
            getattr(args, "reflection", False),
            health_port=getattr(args, "health_port", 0) or None,
        )


# A server that comes back gets calls within about a second: gRPC's default reconnect backoff
# grows to 120 s, during which a channel fails fast without even trying the restarted server.
# The gateway's channels to its replicas use these, and so do the client library's to gateways
# (a stream resuming on a gateway that was restarted a moment ago).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def channel_options(max_message_mb: int = 64) -> list[tuple[str, int]]:
    """Options for servers and clients alike: big tensors, and keepalives that keep long idle
    streams (a client waiting on its LLM) alive through proxies without being called abusive."""
    size = max_message_mb << 20
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]


def bind_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on, in words; None when it can. Probes the way grpc
    binds (SO_REUSEADDR, so a port in TIME_WAIT is free), so a taken port is named before grpc
    logs its own multi-line complaint."""
    addr = host.strip("[]")
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"{host}:{port} is already in use (another process listens there)"
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def setup_logging(level: str = "INFO", service: str = "token2wav") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s {service} [%(request_id)s] %(name)s: %(message)s"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


async def _fail(context: grpc.aio.ServicerContext, method: str, exc: Exception):
    mapped = status_for(exc)
    if mapped is None:
        logger.exception("internal error in %s", method)
        mapped = (grpc.StatusCode.INTERNAL, "internal error (logged on the server)")
    elif isinstance(exc, BadMessage):
        logger.warning("%s from %s: %s", method, context.peer(), exc.message)  # one line
    RPC_CALLS.labels(method, mapped[0].name).inc()
    await context.abort(mapped[0], mapped[1])


class _Undecodable:
    """What a request deserializer returns for bytes that do not parse; the handler wrapper
    turns it into INVALID_ARGUMENT (grpc itself would log a traceback and answer INTERNAL or
    UNKNOWN)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError and whatever a parser raises
            return _Undecodable(exc)

    return parse


def _checked(request, method: str):
    if isinstance(request, _Undecodable):
        raise BadMessage(method, request.error)
    return request


async def _checked_stream(requests, method: str):
    async for request in requests:
        yield _checked(request, method)


def _count_ok(method: str, start: float) -> None:
    RPC_CALLS.labels(method, "OK").inc()
    RPC_SECONDS.labels(method).observe(time.perf_counter() - start)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """The single place where exceptions become status codes (and call metrics are counted)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        # Reflection goes through here too: a token check in front of it must map to a status.
        if handler is None or details.method.startswith("/grpc.health"):
            return handler
        method = details.method

        def wrap_unary(behavior, check):
            async def call(request, context):
                start = time.perf_counter()
                try:
                    result = await behavior(check(request, method), context)
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped or logged in _fail
                    await _fail(context, method, exc)
                _count_ok(method, start)
                return result

            return call

        def wrap_stream(behavior, check):
            async def call(request, context):
                start = time.perf_counter()
                try:
                    async for item in behavior(check(request, method), context):
                        yield item
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:  # noqa: BLE001
                    await _fail(context, method, exc)
                _count_ok(method, start)

            return call

        kw = dict(
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary, _checked), **kw
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary, _checked_stream), **kw
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream, _checked), **kw
            )
        return grpc.stream_stream_rpc_method_handler(
            wrap_stream(handler.stream_stream, _checked_stream), **kw
        )


class Service(Protocol):
    """What the listener needs of the service it serves (`token2wav.service.Service` is the
    one implementation)."""

    grpc_services: tuple[str, ...]

    def register(self, server: grpc.aio.Server) -> None: ...

    def start(self) -> None: ...

    async def warmup(self) -> None: ...

    async def stop(self) -> None: ...


class GrpcServer:
    """The listener of one service process (`token2wav.service.Service`): `await start()`, then
    the service warms up, `set_serving(True)`, and `drain()` ends both.

    The service's `register(server)` adds its servicers; its `grpc_services` are their full
    names, used for health and reflection; its `stop()` runs after the listener drained.
    """

    def __init__(self, options: ServerOptions, service: Service):
        self.options = options
        self.service = service
        self.service_names = list(service.grpc_services)
        self.server: grpc.aio.Server | None = None
        self.health = HealthServicer()
        self.port = 0
        self.metrics_port = 0
        self.health_port = 0
        self._health_server: grpc.aio.Server | None = None
        self._metrics_httpd = None
        self._serving: bool | None = None  # what health last said; None before the first call
        self._stop = asyncio.Event()
        self.exit = os._exit  # how exit_for_restart ends the process (tests put their own)
        service.listener = self

    async def start(self) -> int:
        opts = self.options
        self.server = grpc.aio.server(
            # Tracing outermost: its span then sees the status the error mapping chose.
            interceptors=[*tracing.server_interceptors(), ErrorInterceptor(), *opts.interceptors],
            # No SO_REUSEPORT: with it a second server binds a taken port silently and the
            # two split the connections; without it a taken port fails here, at start.
            options=[*channel_options(opts.max_message_mb), ("grpc.so_reuseport", 0)],
        )
        self.service.register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if opts.reflection:
            reflection.enable_server_reflection(
                [
                    *self.service_names,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ],
                self.server,
            )
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{opts.host}:{opts.port}"
        problem = bind_problem(opts.host, opts.port) if opts.port else None
        if problem is None:
            try:
                if opts.tls_cert:
                    creds = server_credentials(opts.tls_cert, opts.tls_key, opts.tls_client_ca)
                    self.port = self.server.add_secure_port(address, creds)
                else:
                    self.port = self.server.add_insecure_port(address)
            except RuntimeError:  # grpc says only "Failed to bind"
                self.port = 0
        if self.port == 0:
            problem = problem or bind_problem(opts.host, opts.port) or "cannot listen there"
            raise StartupError(f"--port {opts.port}: {problem}")
        await self.server.start()
        if opts.health_port is not None:
            await self._start_health(opts.host, opts.health_port)
        if opts.metrics_port is not None:
            try:
                self._metrics_httpd, _ = start_http_server(opts.metrics_port, addr=opts.host)
            except OSError as exc:
                await self.server.stop(None)
                raise StartupError(
                    f"--metrics-port {opts.metrics_port}: cannot listen on "
                    f"{opts.host}:{opts.metrics_port}: {exc.strerror or exc} "
                    "(another process has it? 0 turns metrics off)"
                ) from None
            self.metrics_port = self._metrics_httpd.server_port
        logger.info(
            "listening on %s:%d (%s; metrics %s; plaintext health %s)",
            opts.host,
            self.port,
            ("mutual TLS" if opts.tls_client_ca else "TLS") if opts.tls_cert else "plaintext",
            self.metrics_port or "off",
            self.health_port or "off",
        )
        return self.port

    async def _start_health(self, host: str, port: int) -> None:
        """The health port: the same health servicer as the main listener, nothing else, no
        TLS, so a probe needs no key (the kubelet's gRPC probe speaks plaintext only). It tells
        anyone who can reach it SERVING or NOT_SERVING, and nothing more."""
        self._health_server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", 4096), ("grpc.so_reuseport", 0)]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        problem = bind_problem(host, port) if port else None
        if problem is None:
            try:
                self.health_port = self._health_server.add_insecure_port(f"{host}:{port}")
            except RuntimeError:
                self.health_port = 0
        if self.health_port == 0:
            await self.server.stop(None)
            problem = problem or bind_problem(host, port) or "cannot listen there"
            raise StartupError(f"--health-port {port}: {problem}")
        await self._health_server.start()

    async def _set_all(self, status) -> None:
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def set_serving(self, serving: bool) -> None:
        await self._set_all(
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        # Logged where health changes, not where the service asks: a gateway's health also
        # waits for its replicas, so "SERVING" in the log is what its clients see.
        if serving != self._serving and (serving or self._serving is not None):
            logger.info("SERVING" if serving else "NOT_SERVING")
        self._serving = serving

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)

    def request_stop(self, why: str = "stop requested") -> None:
        if not self._stop.is_set():
            logger.info("%s: draining", why)
            self._stop.set()

    async def drain(self) -> None:
        """NOT_SERVING, wait the drain delay, then stop(grace): in-flight calls finish, new ones
        get UNAVAILABLE, and whatever is still running when the grace ends is cancelled; then
        the service's background work stops."""
        await self.set_serving(False)
        if self.options.drain_delay > 0:
            await asyncio.sleep(self.options.drain_delay)
        await self._close(self.options.grace_period)
        logger.info("stopped")

    async def exit_for_restart(self, why: str, status: int = EXIT_DEVICE_LOST) -> None:
        """The process can serve nothing again (a broken CUDA context): health NOT_SERVING at
        once, the listener closed after a short grace (the calls already answered UNAVAILABLE
        reach their callers, who retry elsewhere), then `exit(status)` without the usual
        teardown, which would wait on work stuck on the broken device. Non-zero, so that the
        supervisor restarts the process."""
        logger.critical("%s: NOT_SERVING, exiting with status %d for a restart", why, status)
        await self.set_serving(False)
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.stop(1.0), 5.0)
            except TimeoutError:
                pass
        for handler in logging.getLogger().handlers:  # os._exit flushes nothing
            try:
                handler.flush()
            except (OSError, ValueError):  # a closed stream must not keep a broken replica up
                pass
        self.exit(status)

    async def kill(self) -> None:
        """Stop at once, as a crashed process would: every call on it ends now (tests)."""
        await self._close(None)

    async def _close(self, grace: float | None) -> None:
        if self.server is not None:
            await self.server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(None)
            self._health_server = None
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd = None
        await self.service.stop()

    async def run(self) -> None:
        """The whole life of a service process; returns after a signal-initiated drain."""
        try:
            await self.start()
            self.install_signal_handlers()
            self.service.start()
            await self.service.warmup()
        except BaseException:
            await self._close(None)
            raise
        if not self._stop.is_set():
            await self.set_serving(True)
        await self._stop.wait()
        await self.drain()
