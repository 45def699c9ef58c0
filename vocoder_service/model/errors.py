"""Typed errors of the vocoder model (bad input is `token2wav.invalid.InvalidInput`, shared
with the flow model). No grpc here."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """hift.pt is missing, unreadable, or does not match the architecture key for key."""
