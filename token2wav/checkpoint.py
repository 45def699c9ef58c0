"""Reading a weights file (`flow.pt`, `hift.pt`) with tensors only, failing in one line.

torch's own messages for a bad file run to many lines and advise `weights_only=False`, which
would execute whatever the file holds; the services never do that, so the message is replaced
by a short description of what is wrong with the file.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch


def describe_load_failure(path: Path, exc: BaseException) -> str:
    """What is wrong with `path`, given the exception torch.load(weights_only=True) raised."""
    if isinstance(exc, pickle.UnpicklingError) and zipfile.is_zipfile(path):
        return "holds objects other than tensors, which are never unpickled; not a weights file"
    if isinstance(exc, (pickle.UnpicklingError, KeyError, EOFError)):
        return "not a torch checkpoint (corrupt, or another format)"
    if "PytorchStreamReader" in str(exc):
        return "corrupt or truncated checkpoint (its zip archive cannot be read)"
    first = (str(exc).strip().splitlines() or [""])[0][:120]
    return f"not a loadable torch checkpoint ({type(exc).__name__}: {first})"


def load_tensors(path: Path, error: type[Exception]):
    """torch.load(path) onto the CPU with weights_only=True (memory-mapped when the format
    allows); any failure raises `error` with one line naming the file."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) serialisation cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad checkpoint
        raise error(f"{path}: {describe_load_failure(path, exc)}") from None
