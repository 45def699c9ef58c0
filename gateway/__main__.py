"""`python -m gateway`: the public streaming API of token2wav."""

from __future__ import annotations

import sys

from gateway.config import build_parser
from gateway.service import GatewayService
from token2wav.service import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(GatewayService, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
