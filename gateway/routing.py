"""Finding replicas: a static list or a DNS name, one channel per address.

Flow calls are stateless and idempotent, but a flow replica keeps a prefix cache per stream
(keys/values of the blocks earlier calls computed), so a stream's calls go to one replica too,
and move to the next-ranked replica on UNAVAILABLE (a cache miss there, same mel); calls
without a request id go round robin. A stream's vocoder session lives on one replica. Both are
chosen by rendezvous (highest random weight) hashing of the request id over the current
addresses: every gateway picks the same replica for the same id, and adding or removing a
replica moves only the streams that hashed to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import time

import grpc

from token2wav import tracing
from token2wav.server import RECONNECT_OPTIONS, channel_options

logger = logging.getLogger(__name__)


def parse_spec(spec: str) -> tuple[list[str], tuple[str, int] | None]:
    """'h1:p1,h2:p2' -> (addresses, None); 'dns:///name:port' -> ([], (name, port))."""
    spec = spec.strip()
    if spec.startswith("dns:///"):
        host, _, port = spec[len("dns:///") :].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad DNS target {spec!r}: want dns:///NAME:PORT")
        return [], (host, int(port))
    addrs = [a.strip() for a in spec.split(",") if a.strip()]
    for a in addrs:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad address {a!r}: want HOST:PORT")
    if not addrs:
        raise ValueError("no addresses given")
    return addrs, None


def rendezvous_order(key: str, addresses: list[str]) -> list[str]:
    """`addresses` by falling rendezvous weight for `key`: the first is the key's replica, the
    rest are where it goes when that one is unavailable (the same order on every gateway)."""

    def weight(addr: str) -> int:
        return int.from_bytes(
            hashlib.blake2b(f"{key}|{addr}".encode(), digest_size=8).digest(), "big"
        )

    return sorted(addresses, key=weight, reverse=True)


def rendezvous(key: str, addresses: list[str]) -> str:
    return rendezvous_order(key, addresses)[0]


class ReplicaSet:
    def __init__(
        self,
        spec: str,
        *,
        refresh_s: float = 5.0,
        max_message_mb: int = 64,
        retire_grace_s: float = 330.0,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str | None = None,
    ):
        self.spec = spec
        self._static, self._dns = parse_spec(spec)
        self.refresh_s = refresh_s
        self._options = channel_options(max_message_mb) + RECONNECT_OPTIONS
        self._credentials = credentials  # None: plaintext
        if server_name:  # replicas dialled by IP whose certificates carry a name
            self._options.append(("grpc.ssl_target_name_override", server_name))
        self._addresses: list[str] = list(self._static)
        self._resolved_at = -1e9
        self._channels: dict[str, grpc.aio.Channel] = {}  # address -> channel
        # A replica that left DNS (scale-down, rollout) is draining: no new calls go there, but
        # its channel stays open for the calls already on it (a vocoder session lasts as long
        # as its stream) until they end or this grace runs out.
        self.retire_grace_s = retire_grace_s
        self._retiring: dict[asyncio.Task, grpc.aio.Channel] = {}
        self._next = 0
        self._lock = asyncio.Lock()
        # Replicas that failed their last active health check (gateway/health.py): tried last.
        self.unhealthy: set[str] = set()
        self.health_checked = False  # set by gateway/health.py when it checks these replicas

    async def addresses(self) -> list[str]:
        if self._dns and time.monotonic() - self._resolved_at > self.refresh_s:
            async with self._lock:
                if time.monotonic() - self._resolved_at > self.refresh_s:
                    await self._resolve()
        if not self._addresses:
            raise OSError(f"no replicas resolved for {self.spec}")
        return self._addresses

    async def _resolve(self) -> None:
        host, port = self._dns
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            logger.warning(
                "cannot resolve %s: %s (keeping %d known replicas)", host, exc, len(self._addresses)
            )
            self._resolved_at = time.monotonic() - self.refresh_s + 1.0  # retry in a second
            return
        addrs = sorted(
            {f"[{i[4][0]}]:{port}" if ":" in i[4][0] else f"{i[4][0]}:{port}" for i in infos}
        )
        if addrs != self._addresses:
            logger.info("%s -> %s", self.spec, addrs)
            for gone in set(self._channels) - set(addrs):
                channel = self._channels.pop(gone)
                task = asyncio.get_running_loop().create_task(
                    channel.close(grace=self.retire_grace_s)
                )
                self._retiring[task] = channel
                task.add_done_callback(lambda t: self._retiring.pop(t, None))
        self._addresses = addrs
        self._resolved_at = time.monotonic()

    def channel(self, addr: str) -> grpc.aio.Channel:
        ch = self._channels.get(addr)
        if ch is None:
            if self._credentials is not None:
                ch = grpc.aio.secure_channel(
                    addr,
                    self._credentials,
                    options=self._options,
                    interceptors=tracing.client_interceptors(),
                )
            else:
                ch = grpc.aio.insecure_channel(
                    addr, options=self._options, interceptors=tracing.client_interceptors()
                )
            self._channels[addr] = ch
        return ch

    def eject(self, addr: str) -> None:
        """A call found `addr` down: try it last until the next health round finds it SERVING
        (passive outlier ejection; a no-op without health checks, which would never undo it)."""
        if self.health_checked:
            self.unhealthy = self.unhealthy | {addr}

    async def round_robin(self) -> list[str]:
        """All addresses, starting at the next one in turn (the rest are retry targets)."""
        addrs = await self.addresses()
        start = self._next % len(addrs)
        self._next += 1
        return self._healthy_first(addrs[start:] + addrs[:start])

    def _healthy_first(self, order: list[str]) -> list[str]:
        if not self.unhealthy:
            return order
        return [a for a in order if a not in self.unhealthy] + [
            a for a in order if a in self.unhealthy
        ]

    async def ranked(self, key: str) -> list[str]:
        """All addresses, `key`'s replica first (the rest are retry targets, in order);
        unhealthy replicas last."""
        return self._healthy_first(rendezvous_order(key, await self.addresses()))

    async def pick(self, key: str, exclude: set[str] | frozenset[str] = frozenset()) -> str:
        """The replica for `key`, skipping `exclude` (replicas that failed it) while another
        is known; with none left, the same replica again (it may have restarted)."""
        addrs = await self.addresses()
        usable = [a for a in addrs if a not in exclude]
        healthy = [a for a in usable if a not in self.unhealthy]
        return rendezvous(key, healthy or usable or addrs)

    @property
    def num_retiring(self) -> int:
        """Channels of replicas that left DNS, still open for their calls."""
        return len(self._retiring)

    async def close(self) -> None:
        for ch in [*self._channels.values(), *self._retiring.values()]:
            await ch.close()
        self._channels.clear()
        for task in list(self._retiring):
            task.cancel()
        self._retiring.clear()
