"""Active health checks of the flow and vocoder replicas, and the gateway's own health.

Every `interval` s the gateway asks each replica's grpc.health.v1 (short timeout). Replicas that
do not answer SERVING are marked unhealthy in their ReplicaSet: new calls and sessions go to the
healthy ones first (calls still reach an unhealthy one when no other is left). A replica that
comes back is healthy again at the next round (rounds come every 0.2 s while a replica is
unhealthy), so it gets traffic within about 0.2 s.
The gateway reports NOT_SERVING while a stage has no healthy replica (and SERVING again once
it has), so load balancers stop sending it streams it can only fail; after start it waits for
every replica to answer once (at most STARTUP_GRACE_S).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.routing import ReplicaSet
from gateway.websocket import WebSocketBridge
from token2wav.errors import StartupError
from token2wav.server import GrpcServer

logger = logging.getLogger(__name__)

FAST_RECHECK_S = 0.2  # s between rounds while a replica is unhealthy
STARTUP_GRACE_S = 10.0  # s after start a gateway waits for all its replicas before SERVING


async def _serving(replicas: ReplicaSet, addr: str, timeout: float) -> bool:
    stub = health_pb2_grpc.HealthStub(replicas.channel(addr))
    try:
        # wait_for_ready: a channel in reconnect backoff connects now instead of failing fast
        resp = await stub.Check(
            health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=True
        )
    except grpc.aio.AioRpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


class StageHealth:
    def __init__(self, stages: dict[str, ReplicaSet], interval: float, timeout: float = 0.5):
        self.stages = stages  # stage name -> its replicas
        self.interval = interval
        self.timeout = min(timeout, interval)
        self.down: set[str] = set()  # stages without a healthy replica
        for replicas in stages.values():
            replicas.health_checked = interval > 0
        self.all_seen = False  # some round found every replica healthy

    def next_check_in(self) -> float:
        """The interval; shorter while some replica is unhealthy, so one that comes back (or
        finishes warming up) gets traffic quickly."""
        if any(r.unhealthy for r in self.stages.values()):
            return min(self.interval, FAST_RECHECK_S)
        return self.interval

    async def check(self) -> set[str]:
        """One round over every replica; returns the stages with no healthy replica."""
        down = set()
        for name, replicas in self.stages.items():
            try:
                addrs = list(await replicas.addresses())
            except OSError:
                addrs = []
            ok = await asyncio.gather(*[_serving(replicas, a, self.timeout) for a in addrs])
            unhealthy = {a for a, good in zip(addrs, ok) if not good}
            for addr in unhealthy ^ replicas.unhealthy:
                state = "unhealthy" if addr in unhealthy else "healthy again"
                logger.info("%s replica %s %s", name, addr, state)
            replicas.unhealthy = unhealthy
            if not any(ok):
                down.add(name)
        if not any(r.unhealthy for r in self.stages.values()):
            self.all_seen = True
        if down != self.down:
            if down:
                logger.warning("no healthy %s replica: reporting NOT_SERVING", ", ".join(down))
            else:
                logger.info("every stage has a healthy replica again")
        self.down = down
        return down


class GatewayServer(GrpcServer):
    """GrpcServer whose SERVING also needs a healthy replica of every stage; with `websocket`,
    that endpoint too, started and stopped with the gRPC listener it relays to."""

    def __init__(
        self,
        *args,
        health: StageHealth | None = None,
        websocket: WebSocketBridge | None = None,
        **kw,
    ):
        super().__init__(*args, **kw)
        self.websocket = websocket
        self.stage_health = health if health is not None and health.interval > 0 else None
        self._want_serving = False
        self._monitor: asyncio.Task | None = None
        self._started_at = time.monotonic()

    async def start(self) -> int:
        self._started_at = time.monotonic()
        port = await super().start()
        if self.websocket is not None:
            host = self.options.host
            # A wildcard listener answers on loopback; a specific address only on itself.
            dial = "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host
            try:
                await self.websocket.start(f"{dial}:{port}")
            except OSError as exc:
                await self.kill()
                raise StartupError(
                    f"--websocket-port {self.websocket.port}: cannot listen on "
                    f"{self.websocket.host}: {exc.strerror or exc}"
                ) from None
        if self.stage_health is not None:
            await self.stage_health.check()
            self._monitor = asyncio.get_running_loop().create_task(self._watch())
        return port

    async def set_serving(self, serving: bool) -> None:
        self._want_serving = serving
        await self._apply()

    async def _apply(self) -> None:
        """SERVING when wanted and every stage has a healthy replica; right after start, only
        once every replica answered (or STARTUP_GRACE_S passed), so a freshly started stack
        does not send all its first streams to whichever replica warmed up first."""
        ok = True
        if self.stage_health is not None:
            started = time.monotonic() - self._started_at > STARTUP_GRACE_S
            ok = not self.stage_health.down and (self.stage_health.all_seen or started)
        await super().set_serving(self._want_serving and ok)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.stage_health.next_check_in())
            try:
                await self.stage_health.check()
                await self._apply()
            except Exception:  # noqa: BLE001 - a bad round must not end the monitor
                logger.exception("health check round failed")

    async def drain(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None
        if self.websocket is not None:
            self.websocket.stop_accepting()
        await super().drain()
        if self.websocket is not None:
            await self.websocket.stop()

    async def kill(self) -> None:
        if self.websocket is not None:
            await self.websocket.stop()
        await super().kill()
