"""`python -m vocoder_service`: the Stage-2 vocoder server (mel -> 24 kHz audio), one HiFT cache
session per stream, batched across sessions. Every flag mirrors a VOCODER_* env var."""

from __future__ import annotations

import sys

from token2wav.service import run_service
from vocoder_service.config import build_parser
from vocoder_service.service import VocoderService


def main(argv: list[str] | None = None) -> int:
    return run_service(VocoderService, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
