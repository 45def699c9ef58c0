"""Typed errors raised inside the services; `ErrorInterceptor` maps them to gRPC status codes.

The mapping is the status-code table of ARCHITECTURE.md. Anything else that escapes a handler
is a broken invariant: INTERNAL, logged with its traceback, never sent to the client.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """Base class: an error with a gRPC status code and a message safe to show the client."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError, ValueError):
    """A request field is malformed. `field` names it (dotted path, e.g. `voice.prompt_feat`)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class Aborted(ServiceError):
    code = grpc.StatusCode.ABORTED


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(ServiceError):
    """The call needs something this server was not started with (the message names the flag)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The (code, message) for an expected error, or None for a bug.

    Model packages raise their own `ValueError` subclasses carrying a `.field` attribute (they
    must not import grpc); those are client mistakes too.
    """
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, ValueError) and getattr(exc, "field", None):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return None
