"""A stand-in service on the shared bootstrap, run as a subprocess by test_bootstrap.py.

Method /test.Slow/Count streams N byte messages, one every DELAY seconds (request: b"N,DELAY").
It warms up for --warmup seconds before going SERVING, like a real service loading its model.
"""

import argparse
import asyncio
import sys

import grpc

from token2wav.server import ServerOptions
from token2wav.service import Service


async def count(request: bytes, context):
    n, delay = request.decode().split(",")
    for i in range(int(n)):
        await asyncio.sleep(float(delay))
        yield str(i).encode()


class Slow(Service):
    grpc_services = ("test.Slow",)

    def register(self, server):
        handler = grpc.method_handlers_generic_handler(
            "test.Slow", {"Count": grpc.unary_stream_rpc_method_handler(count)}
        )
        server.add_generic_rpc_handlers((handler,))

    async def warmup(self):
        print(f"PORT {self.server.port} {self.server.metrics_port}", flush=True)
        await asyncio.sleep(self.config.warmup)


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--drain-delay", type=float, default=0.5)
    p.add_argument("--grace", type=float, default=5.0)
    a = p.parse_args()
    a.server = ServerOptions(
        port=0, metrics_port=0, grace_period=a.grace, drain_delay=a.drain_delay
    )
    service = Slow(a)
    service.server = service.make_server()
    await service.server.run()
    print("EXITED", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
