"""The skeleton every token2wav process shares: a frozen config, a `Service`, `serve`.

A service package holds three things, the same way in all three packages:

- `config.py`: `build_parser()` (every flag, mirrored by an env var) and a frozen `Config`
  whose `from_args(args)` is the one place flags become values (a bad value: ValueError naming
  the flag); `config.server` is the listener's `ServerOptions`.
- `service.py`: a `Service` subclass owning the servicers and the background work: `register`
  adds the servicers to a grpc server, `start()` starts background tasks, `warmup()` makes the
  first real call fast, `stop()` ends the work after the listener drained.
- `__main__.py`: `main(argv)` = `run_service(...)` below.

`serve(service)` runs a service for the life of a process (signals, drain); `start(service)`
starts one in a running event loop for tests and benchmarks (`await server.drain()` ends it).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import grpc

from token2wav import tracing
from token2wav.cli import EnvParser, run_main
from token2wav.errors import StartupError
from token2wav.server import GrpcServer, ServerOptions, bind_problem, setup_logging


class Service:
    """What one process serves. Subclasses set the class attributes and implement `register`;
    the hooks do nothing by default (a bare `Service(None)` serves health only: tests)."""

    prog: ClassVar[str] = "token2wav"  # python -m <prog>; start-up errors say "<prog>: error:"
    log_name: ClassVar[str] = "token2wav"  # the service's name in each log line
    config_class: ClassVar[Any] = None  # its frozen config, with from_args(args)
    grpc_services: ClassVar[tuple[str, ...]] = ()  # full names of the servicers `register` adds

    @staticmethod
    def check(config: Any) -> None:
        """Fail fast, before anything loads, on what this machine cannot do (the device)."""

    def __init__(self, config: Any):
        self.config = config
        self.listener: GrpcServer | None = None  # set by the GrpcServer serving it
        self._exiting: asyncio.Task | None = None

    @property
    def options(self) -> ServerOptions:
        return self.config.server

    def register(self, server: grpc.aio.Server) -> None:
        """Add the servicers (e.g. `add_FlowServicer_to_server(self.servicer, server)`)."""

    def make_server(self) -> GrpcServer:
        """The listener; a service whose health depends on more than itself overrides this."""
        return GrpcServer(self.options, self)

    def start(self) -> None:
        """Start background work (batch loops, sweepers); called in the event loop."""

    async def warmup(self) -> None:
        """Run what makes the first real call fast; SERVING follows."""

    async def stop(self) -> None:
        """End the background work and release resources; the listener has drained."""

    def device_lost(self, exc: BaseException) -> None:
        """Event loop: the device is unusable for this process's life (token2wav/faults.py).
        The listener goes NOT_SERVING and the process exits non-zero for a restart."""
        if self._exiting is None and self.listener is not None:
            self._exiting = asyncio.get_running_loop().create_task(
                self.listener.exit_for_restart(f"{self.log_name}: device lost ({exc})"),
                name="exit-for-restart",
            )


async def serve(service: Service) -> None:
    """The life of a service process: listen, warm up, SERVING, then drain on SIGTERM/SIGINT."""
    await service.make_server().run()


async def start(service: Service, *, warmup: bool = True) -> GrpcServer:
    """A listening, warmed-up, SERVING server in the running loop (tests, benchmarks); `await
    server.drain()` stops it and its service. `warmup=False` skips the warm-up (tests that
    count the model's calls, or cannot spend its time)."""
    server = service.make_server()
    await server.start()
    try:
        service.start()
        if warmup:
            await service.warmup()
    except BaseException:
        await server.kill()
        raise
    await server.set_serving(True)
    return server


def check_ports(args: Any) -> None:
    """Fail at once, in one line, when --port, --metrics-port or --health-port is taken: before
    a model loads for minutes only to find its port in use (the server checks again when it
    binds)."""
    ports = (
        ("--port", args.port),
        ("--metrics-port", args.metrics_port),
        ("--health-port", args.health_port),
    )
    for flag, port in ports:
        problem = bind_problem(args.host, port) if port else None
        if problem is not None:
            raise StartupError(f"{flag} {port}: {problem}")


class UsageError(ValueError):
    """A flag's value cannot be used (said in one line that names the flag); the command
    answers it as argparse answers a bad flag."""


def run_service(service_class: type[Service], parser: EnvParser, argv: list[str] | None) -> int:
    """`python -m <prog>`: flags -> config (a bad value is a usage error, exit 2), the ports and
    `check(config)` before anything loads, then the service until a signal. Start-up failures
    (port taken, no CUDA, bad weights) end as one line, details at DEBUG."""
    args = parser.parse_args(argv)
    setup_logging(args.log_level, service_class.log_name)

    def body() -> None:
        try:
            config = service_class.config_class.from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
        check_ports(config.server)
        service_class.check(config)
        tracing.setup(service_class.log_name)  # off unless OTEL_* asks for it
        try:
            service = service_class(config)  # loads the model: outside the event loop
        except UsageError as exc:
            parser.error(str(exc))
        asyncio.run(serve(service))

    return run_main(service_class.prog, body)


__all__ = ["Service", "StartupError", "UsageError", "run_service", "serve", "start"]
