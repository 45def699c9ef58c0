"""`python -m gateway`: the public streaming API of token2wav."""

from __future__ import annotations

import asyncio
import sys

from gateway.app import build_parser, create_server, load_voice_maker
from token2wav.cli import run_main
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

    # start-up failures (port taken) end as one line; the traceback at --log-level debug
    return run_main("gateway", lambda: asyncio.run(run()))


if __name__ == "__main__":
    sys.exit(main())
