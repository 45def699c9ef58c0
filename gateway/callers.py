"""Who is calling, and what each caller may hold: concurrent streams per client.

A client is its authenticated identity (gateway/security.py) or, with authentication off, the
host part of its peer address (behind a proxy that is the proxy: leave the per-client limits
off there, or turn authentication on).
"""

from __future__ import annotations

import grpc

from token2wav.errors import ResourceExhausted
from token2wav.security import identity_var


def peer_host(context: grpc.aio.ServicerContext) -> str:
    """'ipv4:10.0.0.7:51234' -> 'ipv4:10.0.0.7'; 'ipv6:[::1]:5' -> 'ipv6:[::1]'."""
    peer = context.peer() or "unknown"
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


def client_of(context: grpc.aio.ServicerContext) -> str:
    identity = identity_var.get()
    return f"id:{identity}" if identity else peer_host(context)


class ClientStreams:
    """Concurrent streams per client, bounded (0: no bound)."""

    def __init__(self, max_per_client: int = 0):
        self.max_per_client = max_per_client
        self._open: dict[str, int] = {}  # client -> open streams

    def acquire(self, client: str) -> None:
        n = self._open.get(client, 0)
        if self.max_per_client and n >= self.max_per_client:
            raise ResourceExhausted(
                f"this client has {n} streams open, its limit (--max-streams-per-client)"
            )
        self._open[client] = n + 1

    def release(self, client: str) -> None:
        n = self._open.get(client, 0) - 1
        if n > 0:
            self._open[client] = n
        else:
            self._open.pop(client, None)
