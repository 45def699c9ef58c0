"""Command-line flags that mirror environment variables.

Every flag `--some-flag` of service PREFIX also reads `PREFIX_SOME_FLAG` from the environment
(the flag wins), and its --help line shows the variable and the default, so a container can be
configured with env vars alone and a human can see everything with --help.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

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
    """Flags every service shares (transport, metrics, lifecycle, logging)."""
    parser.flag(
        "--host", default="127.0.0.1", help="address to bind; 0.0.0.0 or [::] in containers"
    )
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
        default=30.0,
        help="seconds in-flight calls get to finish after SIGTERM before they are cancelled",
    )
    parser.flag(
        "--drain-delay",
        type=float,
        default=0.0,
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
        default=True,
        help="serve gRPC reflection (grpcurl can list the API); turn off in production",
    )
    parser.flag("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ...)")
