"""Typed errors of the vocoder model. No grpc here: the service maps them to status codes
(`token2wav.errors.status_for` treats a ValueError with a `.field` as INVALID_ARGUMENT)."""

from __future__ import annotations


class InvalidInput(ValueError):
    """Bad caller input; `field` names it (`mel`, `finalize`, `session`, or `mels[2]`, ... from a
    batched step, where `row` is the offending row's index)."""

    def __init__(self, field: str, problem: str, row: int | None = None):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem
        self.row = row


class CheckpointError(RuntimeError):
    """hift.pt is missing, unreadable, or does not match the architecture key for key."""
