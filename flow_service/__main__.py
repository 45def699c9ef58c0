"""`python -m flow_service`: the Stage-1 flow server (tokens -> mel), batched across streams."""

from __future__ import annotations

import asyncio
import sys

from flow_service.app import build_parser, create_server
from token2wav.cli import check_device, check_ports, run_main
from token2wav.server import setup_logging


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, "flow")

    async def run() -> None:
        server, engine, warmup = create_server(args)
        try:
            await server.run(warmup)
        finally:
            await engine.stop()

    def body() -> None:
        check_ports(args)
        check_device(args.device)
        asyncio.run(run())

    # start-up failures (port taken, no CUDA, bad weights) end as one line; details at DEBUG
    return run_main("flow_service", body)


if __name__ == "__main__":
    sys.exit(main())
