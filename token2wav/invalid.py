"""The one error a model raises for a caller's bad input (no grpc here: the model packages
raise it; `token2wav.errors.status_for` answers it INVALID_ARGUMENT)."""

from __future__ import annotations


class InvalidInput(ValueError):
    """A caller's input that a model refused before touching any state. `field` names it;
    `slot` is the offending request's index in the list a batched call was given (None when
    validated alone), so a batch can fail that one request and run the others; `where` replaces `field` in the message
    (e.g. `chunks[1].tokens[5]`)."""

    def __init__(self, field: str, problem: str, slot: int | None = None, where: str = ""):
        super().__init__(f"{where or field}: {problem}")
        self.field = field
        self.problem = problem
        self.slot = slot
