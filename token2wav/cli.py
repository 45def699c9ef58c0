"""Command-line flags that mirror environment variables.

Every flag `--some-flag` of service PREFIX also reads `PREFIX_SOME_FLAG` from the environment
(the flag wins), and its --help line shows the variable and the default, so a container can be
configured with env vars alone and a human can see everything with --help.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import grpc

from token2wav.errors import StartupError


def prog(module: str) -> str:
    """The program name for usage lines: the console script's own name when started as one
    (`token2wav-flow`), else `python -m MODULE`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("token2wav") else f"python -m {module}"


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


class EnvParser(argparse.ArgumentParser):
    """argparse with an env-var mirror for each option."""

    def __init__(self, env_prefix: str, **kwargs: Any):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(**kwargs)
        self.env_prefix = env_prefix

    def env_name(self, flag: str) -> str:
        return f"{self.env_prefix}_{flag.lstrip('-').replace('-', '_').upper()}"

    def flag(self, name: str, *, type: Any = str, default: Any = None, help: str, **kw: Any):
        """Add `--name`; its default comes from the env var when set."""
        env = self.env_name(name)
        conv = _parse_bool if type is bool else type
        if env in os.environ:
            try:
                default = conv(os.environ[env])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                self.error(f"environment variable {env}={os.environ[env]!r}: {exc}")
        if type is bool:
            kw.setdefault("metavar", "{true,false}")
        return self.add_argument(name, type=conv, default=default, help=f"{help} [env {env}]", **kw)


def add_server_flags(
    parser: EnvParser, *, port: int, metrics_port: int, max_message_mb: int = 64
) -> None:
    """Flags every service shares (transport, metrics, lifecycle, logging); their defaults are
    ServerOptions' but for the three the service gives."""
    from token2wav.server import ServerOptions  # the server stack, only for a service's parser

    d = ServerOptions()
    parser.flag("--host", default=d.host, help="address to bind; 0.0.0.0 or [::] in containers")
    parser.flag("--port", type=int, default=port, help="gRPC port")
    parser.flag(
        "--metrics-port",
        type=int,
        default=metrics_port,
        help="Prometheus /metrics HTTP port; 0 disables the endpoint",
    )
    parser.flag(
        "--grace-period",
        type=float,
        default=d.grace_period,
        help="seconds in-flight calls get to finish after SIGTERM before they are cancelled",
    )
    parser.flag(
        "--drain-delay",
        type=float,
        default=d.drain_delay,
        help="seconds to keep serving with health NOT_SERVING after SIGTERM, so load "
        "balancers stop routing here before the listener closes",
    )
    parser.flag(
        "--max-message-mb",
        type=int,
        default=max_message_mb,
        help="largest gRPC message, MiB, each way; the default fits this service's largest "
        "legal message with room to spare, so no message can balloon memory",
    )
    parser.flag("--tls-cert", help="PEM certificate chain: serve gRPC over TLS (with --tls-key)")
    parser.flag(
        "--tls-key", help="PEM private key of --tls-cert; both files are re-read when they change"
    )
    parser.flag(
        "--tls-client-ca",
        help="PEM CA: demand a client certificate signed by it (mutual TLS)",
    )
    parser.flag(
        "--reflection",
        type=bool,
        default=d.reflection,
        help="serve gRPC reflection (grpcurl can list the API); behind the same bearer token "
        "as the API where --auth-tokens is set",
    )
    parser.flag(
        "--health-port",
        type=int,
        default=d.health_port or 0,  # 0 on the command line: none
        help="plaintext port serving grpc.health.v1 and nothing else (no TLS, no token), for "
        "probes that hold no client certificate: the kubelet's gRPC probe, compose "
        "healthchecks; 0: none (health is always on the gRPC port too)",
    )
    parser.flag("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)")


# -- start-up failures: one line on stderr, the traceback only at debug level -----------------

# Exceptions whose message is meant for the user as it is; anything else is shown with its type.
_USER_ERRORS = (StartupError, OSError, ValueError)


def one_line(exc: BaseException) -> str:
    """A one-line description of `exc`: its first line, the file named for an OSError, the type
    named when it is not a user-facing error, and a pointer to the rest when there is more."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):  # a call's status, as sent
        details = ((exc.details() or "").strip().splitlines() or [""])[0]
        return f"{exc.code().name}: {details}"
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0].strip() if lines else ""
    # Checkpoint errors of both model packages are RuntimeErrors written for the user.
    user = isinstance(exc, _USER_ERRORS) or type(exc).__name__ == "CheckpointError"
    if not user or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if len(lines) > 1 or not user:
        text += " (--log-level debug shows the details)"
    return text


def run_main(prog: str, body: Callable[[], int | None]) -> int:
    """Run a command-line entry point: its exit status, or 1 with one line `prog: error: ...` on
    stderr when it raises (the traceback goes to the log at DEBUG level); 130 on Ctrl-C."""
    try:
        status = body()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure ends as one line, detail at DEBUG
        logging.getLogger(prog).debug("%s failed", prog, exc_info=True)
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr, flush=True)
        return 1
    return 0 if status is None else status


def check_device(device: str, flag: str = "--device") -> None:
    """Fail early, in one line, on a device this torch cannot use (`cuda` on a CPU build)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise StartupError(f"{flag} {device!r}: not a device (cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise StartupError(f"{flag} {device!r}: only cpu and cuda devices are supported")
    if torch.version.cuda is None:
        raise StartupError(
            f"{flag} {device}: this torch ({torch.__version__}) is a CPU-only build; "
            "use --device cpu or install a CUDA build of torch"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise StartupError(f"{flag} {device}: no CUDA device is visible; use --device cpu")
    if dev.index is not None and dev.index >= count:
        raise StartupError(f"{flag} {device}: only {count} CUDA device(s) (cuda:0..{count - 1})")
