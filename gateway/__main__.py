"""`python -m gateway`: the public streaming API of token2wav."""

from __future__ import annotations

import asyncio
import sys

from gateway.app import build_parser, create_server
from token2wav.cli import run_main
from token2wav.server import setup_logging


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, "gateway")

    async def run() -> None:
        server, close = create_server(args)
        try:
            await server.run()  # no model to warm: SERVING as soon as it listens
        finally:
            await close()

    return run_main("gateway", lambda: asyncio.run(run()))


if __name__ == "__main__":
    sys.exit(main())
