"""Parameters that are views of one tensor: linears that read the same input run as one GEMM,
while each keeps its own parameters and state-dict keys (upstream's names, strict loading).

`share_storage_` concatenates parameters along dim 0 into one contiguous tensor and points
each parameter at its rows. The fused tensor is a plain attribute of the module that runs
the GEMM (not a parameter or buffer: no extra key, nothing converted twice), made once and
then stable, so a CUDA graph may bake in its address. Everything that gives parameters
storages of their own breaks the sharing: a conversion (`_apply`: .to(device / dtype),
.half(), .cuda(), to_empty), `load_state_dict(assign=True)`, unpickling or deepcopy. A
`SharesStorage` module re-shares after each of them (a plain `load_state_dict` copies into
the views in place and keeps it). Convert the module that owns the fused tensor (or one
above it), not one of the linears alone: the owner would keep the old rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def shares_storage(params: Sequence[torch.Tensor], fused: torch.Tensor | None) -> bool:
    """Whether `params` are, in order, the consecutive dim-0 slices that make up `fused`."""
    if fused is None or fused.is_meta or not fused.is_contiguous():
        return False  # meta tensors have no addresses to compare
    row_bytes = fused[0].numel() * fused.element_size() if fused.dim() > 1 else fused.element_size()
    rows = 0
    for p in params:
        if (
            p.dtype != fused.dtype
            or p.device != fused.device
            or p.shape[1:] != fused.shape[1:]
            or not p.is_contiguous()
            or p.data_ptr() != fused.data_ptr() + rows * row_bytes
        ):
            return False
        rows += p.shape[0]
    return rows == fused.shape[0]


@torch.no_grad()
def share_storage_(params: Sequence[nn.Parameter], fused: torch.Tensor | None) -> torch.Tensor:
    """Make `params` (same trailing shape, dtype and device) consecutive dim-0 views of one
    contiguous tensor and return it, values kept; `fused` itself, nothing copied, where they
    already are its views."""
    if shares_storage(params, fused):
        return fused
    fused = torch.cat([p.detach() for p in params])
    rows = 0
    for p in params:
        p.data = fused[rows : rows + p.shape[0]]
        rows += p.shape[0]
    return fused


def _reshare(module: SharesStorage, incompatible_keys) -> None:
    module.share_storage()


class SharesStorage(nn.Module):
    """A module whose `share_storage()` (re)builds its fused tensors with `share_storage_`;
    called at the end of its `__init__` by the subclass, then after every conversion, every
    `load_state_dict` and every unpickling or deepcopy."""

    def __init__(self):
        super().__init__()
        self.register_load_state_dict_post_hook(_reshare)  # runs after the children loaded

    def share_storage(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.share_storage()
        return self

    def __setstate__(self, state):
        super().__setstate__(state)
        self.share_storage()
