"""`python -m token2wav.healthcheck [--addr HOST:PORT] [--service NAME]`: exit 0 when the
server reports SERVING over grpc.health.v1, 1 otherwise (for Docker and Kubernetes probes that
have no grpc_health_probe binary)."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from token2wav.cli import prog
from token2wav.security import channel_credentials


def check(
    addr: str,
    service: str = "",
    timeout: float = 3.0,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> bool:
    if tls_ca:
        creds = channel_credentials(tls_ca, tls_cert, tls_key)
        channel = grpc.secure_channel(addr, creds)
    else:
        channel = grpc.insecure_channel(addr)
    with channel:
        try:
            status = (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
                .status
            )
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog("token2wav.healthcheck"), description=__doc__)
    p.add_argument("--addr", default="127.0.0.1:50051", help="server address HOST:PORT")
    p.add_argument("--service", default="", help="service name; empty = the whole server")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.add_argument("--tls-ca", help="PEM CA of a TLS server (unset: plaintext)")
    p.add_argument("--tls-cert", help="PEM client certificate, for a server with mutual TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    a = p.parse_args(argv)
    ok = check(a.addr, a.service, a.timeout, a.tls_ca, a.tls_cert, a.tls_key)
    print("SERVING" if ok else "NOT SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
