"""`python -m flow_service`: the Stage-1 flow server (tokens -> mel), batched across streams."""

from __future__ import annotations

import asyncio
import logging
import sys

from flow_service.app import build_parser, create_server
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

    try:
        asyncio.run(run())
    except Exception:  # noqa: BLE001 - report start-up failures (bad weights, port taken) plainly
        logging.getLogger("flow_service").exception("flow service failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
