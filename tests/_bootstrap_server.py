"""A stand-in service on the shared bootstrap, run as a subprocess by test_bootstrap.py.

Method /test.Slow/Count streams N byte messages, one every DELAY seconds (request: b"N,DELAY").
It warms up for --warmup seconds before going SERVING, like a real service loading its model.
"""

import argparse
import asyncio
import sys

import grpc

from token2wav.server import GrpcServer, ServerOptions


async def count(request: bytes, context):
    n, delay = request.decode().split(",")
    for i in range(int(n)):
        await asyncio.sleep(float(delay))
        yield str(i).encode()


def register(server):
    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Count": grpc.unary_stream_rpc_method_handler(count)}
    )
    server.add_generic_rpc_handlers((handler,))


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--drain-delay", type=float, default=0.5)
    p.add_argument("--grace", type=float, default=5.0)
    a = p.parse_args()
    srv = GrpcServer(
        ServerOptions(port=0, metrics_port=0, grace_period=a.grace, drain_delay=a.drain_delay),
        ["test.Slow"],
        register,
    )

    async def warmup():
        print(f"PORT {srv.port} {srv.metrics_port}", flush=True)
        await asyncio.sleep(a.warmup)

    await srv.run(warmup)
    print("EXITED", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
