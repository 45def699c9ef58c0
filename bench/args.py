"""Flags every `python -m bench` part that builds a model itself shares, stated once."""

from __future__ import annotations

import argparse

from token2wav.dtypes import DTYPES

PRESET = "cosyvoice3-0.5b"


def add_model_args(
    p: argparse.ArgumentParser, *, dtype: str | None = "bfloat16", device: str = "cuda"
) -> None:
    """--device, --preset and (unless dtype is None: the part picks its own) --dtype."""
    p.add_argument("--device", default=device, help=f"torch device (default {device})")
    p.add_argument(
        "--preset", default=PRESET, help=f"model size (default {PRESET}; small: a smoke run)"
    )
    if dtype is not None:
        p.add_argument("--dtype", default=dtype, choices=sorted(DTYPES), help=f"(default {dtype})")
