"""Host -> device copies that do not wait for the card.

A copy from pageable host memory makes PyTorch synchronise the stream, so every small tensor a
batch uploads (token ids, lengths, block ids: about ten a call) used to drain the GPU and hold
the host until it had. Through pinned memory the copy is queued like a kernel; PyTorch's
caching host allocator keeps the pinned buffer until the copy has run.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` as `dtype` on `device`, queued on the current stream when it comes from the host.
    The cast runs where `t` lies, so the device copy is a plain one (same values: a cast
    rounds alike on either side)."""
    if dtype is not None:
        t = t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
