"""GPU faults, sorted by what a replica can do about them, and the tests' way to cause them.

- Out of memory (`is_out_of_memory`): transient and caused by the batch's size. The runners
  free the allocator's cached blocks, split the batch in halves and retry each; a row that runs
  out of memory alone fails alone (`RowOutOfMemory`, turned into RESOURCE_EXHAUSTED naming its
  request by the layer that knows the request ids), and every other row gets its answer.
- A sticky device error (`is_device_lost`): the CUDA context is broken for the life of the
  process, so every later kernel fails too. The replica answers the calls it holds with
  UNAVAILABLE (the gateway retries flow calls and moves vocoder sessions elsewhere), reports
  NOT_SERVING and exits with `EXIT_DEVICE_LOST` so that its supervisor (Kubernetes, compose's
  restart policy) starts a fresh process (`GrpcServer.exit_for_restart`).
- Anything else fails the batch it happened in, as before: a bug, not the device's.

`FaultInjector` is for tests only: a test installs one on a runner (`runner.faults = ...`) to
raise these errors on the CPU; nothing in the services ever creates one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

EXIT_DEVICE_LOST = 70  # EX_SOFTWARE: restart me; a new process gets a new CUDA context

# CUDA errors after which the context is unusable: every later call fails with the same error.
_STICKY = re.compile(
    r"illegal memory access|device-side assert|launch failure|misaligned address"
    r"|illegal instruction|uncorrectable ECC error"
)


def is_out_of_memory(exc: BaseException) -> bool:
    """A device allocation failed (torch.OutOfMemoryError, or a library's own words for it)."""
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "CUDA out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text
    )


def is_device_lost(exc: BaseException) -> bool:
    """A sticky CUDA error: this process's context is broken and only a restart helps."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and "CUDA" in text and bool(_STICKY.search(text))


class RowOutOfMemory(Exception):
    """One row ran out of device memory even in a batch of its own. The message goes to the
    caller, so it leaves out the allocator's figures (the runner logs them)."""

    def __init__(self, cause: BaseException):
        super().__init__("out of GPU memory even in a batch of its own")
        self.cause = cause


def injected_oom() -> BaseException:
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def injected_device_error() -> BaseException:
    return RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


class FaultInjector:
    """Tests only: before each batch the runner calls `check(rows)`, which raises what
    `fail(rows)` returns (None: the batch runs). `rows` are the runner's own rows: FlowRequests
    for the flow runner, the chunks' mel arrays for the vocoder's."""

    def __init__(self, fail: Callable[[Sequence[Any]], BaseException | None]):
        self.fail = fail
        self.num_batches = 0
        self.num_raised = 0

    def check(self, rows: Sequence[Any]) -> None:
        self.num_batches += 1
        exc = self.fail(rows)
        if exc is not None:
            self.num_raised += 1
            raise exc


def without_frames(exc: BaseException) -> BaseException:
    """`exc` with its traceback (and those of the exceptions it chains) cut: a traceback holds
    the frames of the failed batch and with them its tensors, so a retry while it lives runs
    next to all the memory that ran out."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc


def free_device_memory() -> None:
    """Give the failed batch's memory and the allocator's cached blocks back before a retry
    (nothing to do on the CPU)."""
    import gc

    import torch

    gc.collect()  # frames that only a reference cycle still holds

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
