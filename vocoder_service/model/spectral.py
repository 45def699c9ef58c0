"""Source STFT and the iSTFT head for ragged, left-aligned rows (docs/REFERENCE.md §5.2 rows 4 and 10).

Upstream runs `torch.stft(center=True)` (reflect pad n_fft/2 on both ends) on one row and
`torch.istft(center=True)` on one row. In a batch whose rows end at different positions, both
ends must stay each row's own: the STFT here reflects every row at its own last sample, and the
iSTFT zeroes frames past a row's count and normalises by that row's own window envelope, so a
row's samples equal what it would get alone (the tests compare against torch.stft/istft).

Both transforms are 16-point DFTs, done here as one small matrix product each (`dft_bases`,
the window folded in) rather than through torch.fft: no cuFFT plan per batch shape, no
workspace allocated inside a CUDA-graph capture, and no cuFFT call to fail: both vocoder
deaths at start-up seen on an H100 (2 of 17 starts) began with CUFFT_INTERNAL_ERROR in a graph
capture (docs/bench/2026-12-07-h100-main-against-a166548.md). The sums are the DFT's own, in
the same float32, so the values are the FFT's up to rounding (tests/test_vocoder_model.py).

Dimensions (docs/DESIGN.md "Shape letters"):
    b  rows
    l  source samples (row i has lengths[i] valid ones, zero padding after)
    u  STFT frames (hop 4: 120 per mel frame); row i has frames[i] valid ones
    j  FFT bins (n_fft/2 + 1 = 9)
    w  n_fft (16)
"""

from __future__ import annotations

import math

import torch


def hann_window(n_fft: int) -> torch.Tensor:
    """Periodic Hann in float64, like scipy's get_window('hann', n, fftbins=True) before
    upstream's cast to float32 (the cast happens where it is used: `_work_dtype`)."""
    return torch.hann_window(n_fft, periodic=True, dtype=torch.float64)


def dft_bases(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two transforms as matrices (w, 2j), float64, the window folded into each:
    `forward` maps a frame's w samples to [real | imag] of its rfft (window applied first);
    `inverse` maps [real | imag] back to the windowed irfft, the interior bins counted twice
    (their mirror images) and DC and Nyquist once, whose imaginary parts it ignores as
    irfft does (their sines are zero)."""
    n_fft = window.shape[0]
    j = n_fft // 2 + 1
    n = torch.arange(n_fft, dtype=torch.float64, device=window.device)
    k = torch.arange(j, dtype=torch.float64, device=window.device)
    angle = 2 * math.pi * torch.outer(n, k) / n_fft  # (w, j)
    cos, sin = torch.cos(angle), torch.sin(angle)
    sin[:, 0] = sin[:, -1] = 0.0  # DC and Nyquist (n_fft is even): exactly, not sin(pi n)
    win = window.to(torch.float64)[:, None]
    forward = torch.cat([cos, -sin], dim=1) * win
    twice = torch.full((j,), 2.0, dtype=torch.float64, device=window.device)
    twice[0] = twice[-1] = 1.0
    weight = twice / n_fft
    inverse = torch.cat([cos * weight, -sin * weight], dim=1) * win
    return forward, inverse


def windowed_rfft(frames: torch.Tensor, forward: torch.Tensor) -> torch.Tensor:
    """frames (b, u, w) -> [real | imag] (b, u, 2j) of rfft(frames x window)."""
    return frames @ forward


def windowed_irfft(spec: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """[real | imag] (b, 2j, u) -> irfft(spectrum) x window (b, w, u)."""
    return inverse @ spec


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 (upstream's STFT dtype) unless the caller runs in float64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def source_stft(
    s: torch.Tensor,
    lengths: torch.Tensor,
    num_frames: int,
    window: torch.Tensor,
    hop: int,
    forward: torch.Tensor | None = None,
) -> torch.Tensor:
    """s (b, l) with `lengths` [b] valid samples -> [real | imag] (b, 2j, num_frames), float32
    (float64 if s is).

    STFT frame q of row i is centred on sample hop*q of that row and reflect-padded at both of its
    ends, as torch.stft(center=True) would do for the row alone. Frames that would read past a
    row's reflect padding are garbage; callers only use frames < lengths // hop + 1.
    `forward`: `dft_bases(window)[0]`, for a caller that keeps it (None: built here).
    """
    n_fft = window.shape[0]
    half = n_fft // 2
    span = hop * (num_frames - 1) + n_fft
    q = torch.arange(span, device=s.device) - half  # (span,) source index before reflection
    last = (lengths.to(s.device) - 1)[:, None]  # (b, 1)
    idx = q[None, :].abs()  # left reflect: -j -> j
    idx = torch.where(idx > last, 2 * last - idx, idx)  # right reflect at the row's own end
    idx = idx.clamp(0, s.shape[1] - 1)  # (b, span); clamped entries only feed garbage frames
    dtype = _work_dtype(s)
    padded = torch.gather(s.to(dtype), 1, idx)  # (b, span)
    if forward is None:
        forward = dft_bases(window)[0]
    frames = padded.unfold(1, n_fft, hop)  # (b, u, w)
    out = windowed_rfft(frames, forward.to(s.device, dtype))  # (b, u, 2j)
    return out.transpose(1, 2).contiguous()  # (b, 2j, u)


def istft_head(
    x: torch.Tensor,
    frames: torch.Tensor,
    window: torch.Tensor,
    hop: int,
    magnitude_limit: float,
    inverse: torch.Tensor | None = None,
) -> torch.Tensor:
    """conv_post output x (b, 2j, u) -> audio (b, hop*(u-1)) float32 (float64 if x is); row i is
    valid for hop*(frames[i]-1) samples. Magnitude exp(x[:j]) clipped at `magnitude_limit`, phase
    sin(x[j:]) (upstream's redundant sin kept), inverse FFT, Hann, overlap-add, envelope.
    `inverse`: `dft_bases(window)[1]`, for a caller that keeps it (None: built here)."""
    x = x.to(_work_dtype(x))
    b, _, u = x.shape
    n_fft = window.shape[0]
    j = n_fft // 2 + 1
    magnitude = torch.clip(torch.exp(x[:, :j]), max=magnitude_limit)
    phase = torch.sin(x[:, j:])
    spec = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
    if inverse is None:
        inverse = dft_bases(window)[1]
    window = window.to(x.device, x.dtype)
    valid = torch.arange(u, device=x.device)[None, :] < frames.to(x.device)[:, None]  # (b, u)
    seg = windowed_irfft(spec, inverse.to(x.device, x.dtype))  # (b, w, u)
    seg = seg * valid[:, None, :]
    # Overlap-add with n_fft = 4 hop: output block i (hop samples) sums quarter q of frame i-q.
    quarters = n_fft // hop
    y = x.new_zeros(b, u + quarters - 1, hop)  # (b, u + 3, hop)
    env = x.new_zeros(b, u + quarters - 1, hop)
    sq = window.pow(2)
    for q in range(quarters):
        part = slice(q * hop, (q + 1) * hop)
        y[:, q : q + u] += seg[:, part].transpose(1, 2)  # (b, u, hop)
        env[:, q : q + u] += valid[:, :, None] * sq[part]
    half = n_fft // 2
    y = y.reshape(b, -1)[:, half : half + hop * (u - 1)]  # (b, hop*(u-1))
    env = env.reshape(b, -1)[:, half : half + hop * (u - 1)]
    return torch.where(env > 1e-11, y / env.clamp_min(1e-11), torch.zeros_like(y))
