"""Band-limited resampling: the windowed-sinc method of torchaudio's `Resample` with its
defaults (6 zero crossings, roll-off 0.99, Hann window), as upstream's `load_wav` uses it.

Written from the method's description: output sample j of a signal at rate `orig` resampled to
`new` (both divided by their gcd) is the sum over input samples i of

    x[i] * s * sinc(pi * b * (i/orig - j/new)) * cos(pi * t / (2 * w))**2

with b = min(orig, new) * rolloff the cut-off, s = b / orig, t = b * (i/orig - j/new) clamped to
[-w, w], w the zero crossings. Output j + new uses the same weights as j shifted by orig input
samples, so the whole thing is one strided conv1d with `new` filters of length
2 * width + orig. The filters are computed in float64 and used in float32, as torchaudio does;
the offsets j/new are rounded to float32 first, also as torchaudio does by default. Measured
bit-identical to torchaudio 2.11.1's `transforms.Resample` (2026-12-03, 8 rate pairs).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

ZERO_CROSSINGS = 6  # torchaudio's lowpass_filter_width default
ROLLOFF = 0.99


MAX_KERNEL_ELEMENTS = 1 << 20  # 4 MiB of filters; common rates need under 20k


def kernel_elements(orig_rate: int, new_rate: int) -> int:
    """Size of the filter bank `resample` would build (0 when no resampling is needed). Rates
    with a small gcd (44101 Hz) need huge banks and matching compute; callers refuse them."""
    if orig_rate == new_rate:
        return 0
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    width = math.ceil(ZERO_CROSSINGS * orig / (min(orig, new) * ROLLOFF))
    return new * (2 * width + orig)


@lru_cache(maxsize=16)
def sinc_kernel(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """The (new, 1, 2 * width + orig) float32 filters for reduced rates, and width."""
    cutoff = min(orig, new) * ROLLOFF
    width = math.ceil(ZERO_CROSSINGS * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig  # (k,)
    offsets = (torch.arange(0, -new, -1) / new).to(torch.float64)  # (new,) float32-rounded
    t = (offsets[:, None] + taps[None, :]) * cutoff  # (new, k)
    t = t.clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS)
    window = torch.cos(t * (math.pi / ZERO_CROSSINGS / 2)) ** 2
    arg = t * math.pi
    sinc = torch.where(arg == 0, torch.ones_like(arg), torch.sin(arg) / arg)
    kernel = (sinc * window * (cutoff / orig)).to(torch.float32)
    return kernel[:, None, :], width  # (new, 1, k)


def resample(x: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """Resample (..., time) float audio; returns ceil(time * new / orig) samples."""
    if orig_rate == new_rate:
        return x
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernel, width = sinc_kernel(orig, new)
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])  # (b, 1, time)
    padded = F.pad(flat, (width, width + orig))
    out = F.conv1d(padded, kernel.to(x.dtype), stride=orig)  # (b, new, frames)
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)  # (b, frames * new)
    length = math.ceil(new * shape[-1] / orig)
    return out[:, :length].reshape(*shape[:-1], -1)
