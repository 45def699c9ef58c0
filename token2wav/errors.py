"""Typed errors raised inside the services; `ErrorInterceptor` maps them to gRPC status codes.

The mapping is the status codes in docs/OPERATIONS.md ("The wire contract"). Anything else that escapes a handler
is a broken invariant: INTERNAL, logged with its traceback, never sent to the client.
"""

from __future__ import annotations

import re

import grpc
from google.protobuf.message import DecodeError


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


# One request-id charset for every service: ids prefix log lines and name vocoder sessions, so
# no whitespace or control characters (a newline would forge log lines).
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_request_id(request_id: str, field: str = "request_id", *, required: bool = True) -> str:
    """The id unchanged, or InvalidArgument naming `field`; empty passes when not `required`."""
    if not request_id:
        if required:
            raise InvalidArgument(field, "empty; every chunk must name its session")
        return request_id
    if not REQUEST_ID_RE.fullmatch(request_id):
        shown = request_id if len(request_id) <= 40 else request_id[:40] + "..."
        raise InvalidArgument(
            field, f"{shown!r} is not 1..128 characters of [A-Za-z0-9._:-] ({len(request_id)})"
        )
    return request_id


class BadMessage(InvalidArgument):
    """Bytes on the wire that do not parse as the method's request message."""

    def __init__(self, method: str, exc: Exception):
        super().__init__("message", f"not a valid {method.rsplit('/', 1)[-1]} request ({exc})")


_ADDRESS = re.compile(
    r"(ipv[46]:|unix:|dns:///)?(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):\d{2,5}\b"
)


def scrub(text: str) -> str:
    """`text` without HOST:PORT addresses: client-facing messages never name internal replicas."""
    return _ADDRESS.sub("<replica>", text)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The (code, message) for an expected error, or None for a bug.

    Model packages raise their own `ValueError` subclasses carrying a `.field` attribute (they
    must not import grpc); those are client mistakes too.
    """
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, DecodeError):
        return grpc.StatusCode.INVALID_ARGUMENT, "message: not a valid protobuf message"
    if isinstance(exc, ValueError) and getattr(exc, "field", None):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return None


STATUS_KEY = "t2w-status"  # initial metadata of a refused stream: the status code's name
DETAILS_KEY = "t2w-details"  # ... and its message (ASCII)


async def announce_status(context, exc: BaseException) -> None:
    """Send a refusal's status in the initial metadata too, before the call ends: a grpc.aio
    client still writing when the call ends gets `INTERNAL: Internal error from Core` instead
    of our status (grpc/grpc#36066), and `gateway.client.honest_error` recovers it from there."""
    mapped = status_for(exc)
    code, details = mapped if mapped else (grpc.StatusCode.INTERNAL, "internal error")
    text = details.encode("ascii", "backslashreplace").decode()[:512]
    try:
        await context.send_initial_metadata(((STATUS_KEY, code.name), (DETAILS_KEY, text)))
    except Exception:  # noqa: BLE001 - metadata already sent (responses went out): nothing to add
        pass


class StartupError(Exception):
    """A start-up failure the user can fix (port taken, no CUDA, bad checkpoint, missing file).

    Its message is one line that names the flag or the file; `token2wav.cli.run_main` prints it
    without a traceback."""
