"""A stand-in service on the shared bootstrap, run as a subprocess by test_bootstrap.py.

Method /test.Slow/Count streams N byte messages (request: b"N,HELD"): the first HELD at once,
the rest once the test writes "release" on stdin. It warms up (NOT_SERVING) until the test
writes "warm" on stdin, like a real service loading its model. The test drives both with
lines, so nothing here waits for a time.
"""

import argparse
import asyncio
import sys
import threading

import grpc

from token2wav.server import ServerOptions
from token2wav.service import Service


class Gates:
    """One asyncio.Event per word; a line on stdin with that word sets it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *words: str):
        self.events = {w: asyncio.Event() for w in words}
        # A daemon thread: a blocked readline must not keep the process from exiting.
        threading.Thread(target=self._read, args=(loop,), daemon=True).start()

    def _read(self, loop) -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(self.events[line.strip()].set)

    async def wait(self, word: str) -> None:
        await self.events[word].wait()


class Slow(Service):
    grpc_services = ("test.Slow",)

    def register(self, server):
        handler = grpc.method_handlers_generic_handler(
            "test.Slow", {"Count": grpc.unary_stream_rpc_method_handler(self.count)}
        )
        server.add_generic_rpc_handlers((handler,))

    async def count(self, request: bytes, context):
        n, held = (int(x) for x in request.decode().split(","))
        for i in range(n):
            if i == held:
                await self.config.gates.wait("release")
            yield str(i).encode()

    async def warmup(self):
        print(f"PORT {self.server.port} {self.server.metrics_port}", flush=True)
        await self.config.gates.wait("warm")


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--drain-delay", type=float, default=0.5)
    p.add_argument("--grace", type=float, default=5.0)
    a = p.parse_args()
    a.server = ServerOptions(
        port=0, metrics_port=0, grace_period=a.grace, drain_delay=a.drain_delay
    )
    a.gates = Gates(asyncio.get_running_loop(), "warm", "release")
    service = Slow(a)
    service.server = service.make_server()
    await service.server.run()
    print("EXITED", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
