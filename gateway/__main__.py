"""`python -m gateway`: the public streaming API of token2wav."""

from __future__ import annotations

import asyncio
import logging
import sys

from gateway.app import build_parser, create_server, load_voice_maker
from token2wav.frontend.audio import FrontendUnavailable
from token2wav.server import setup_logging


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, "gateway")
    try:
        voice_maker = load_voice_maker(args)  # fail at start, naming what is missing
    except FrontendUnavailable as exc:
        parser.error(f"--frontend-dir: {exc}")

    async def run() -> None:
        server, close = create_server(args, voice_maker)
        try:
            await server.run()  # no model to warm: SERVING as soon as it listens
        finally:
            await close()

    try:
        asyncio.run(run())
    except Exception:  # noqa: BLE001
        logging.getLogger("gateway").exception("gateway failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
