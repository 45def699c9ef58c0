"""argparse types the bench commands share: each turns a bad value into a one-line error that
quotes it. Torch-free, so `python -m bench --help` stays fast."""

from __future__ import annotations

import argparse


def at_least(low: float, kind=int):
    """A `kind` (int or float) of at least `low`."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or v < low:
            raise argparse.ArgumentTypeError(f"want {what} >= {low:g}, got {text!r}")
        return v

    return parse


def positive(text: str) -> float:
    """A number > 0."""
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"want a number > 0, got {text!r}")
    return v
