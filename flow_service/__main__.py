"""`python -m flow_service`: the Stage-1 flow server (tokens -> mel), batched across streams."""

from __future__ import annotations

import sys

from flow_service.config import build_parser
from flow_service.service import FlowService
from token2wav.service import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(FlowService, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
