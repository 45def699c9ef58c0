"""Source STFT and the iSTFT head for ragged, left-aligned rows (docs/REFERENCE.md §5.2 rows 4 and 10).

Upstream runs `torch.stft(center=True)` (reflect pad n_fft/2 on both ends) on one row and
`torch.istft(center=True)` on one row. In a batch whose rows end at different positions, both
ends must stay each row's own: the STFT here reflects every row at its own last sample, and the
iSTFT zeroes frames past a row's count and normalises by that row's own window envelope, so a
row's samples equal what it would get alone (the tests compare against torch.stft/istft).

Dimensions (docs/DESIGN.md "Shape letters"):
    b  rows
    l  source samples (row i has lengths[i] valid ones, zero padding after)
    u  STFT frames (hop 4: 120 per mel frame); row i has frames[i] valid ones
    j  FFT bins (n_fft/2 + 1 = 9)
    w  n_fft (16)
"""

from __future__ import annotations

import torch


def hann_window(n_fft: int) -> torch.Tensor:
    """Periodic Hann in float64, like scipy's get_window('hann', n, fftbins=True) before
    upstream's cast to float32 (the cast happens where it is used: `_work_dtype`)."""
    return torch.hann_window(n_fft, periodic=True, dtype=torch.float64)


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 (upstream's STFT dtype) unless the caller runs in float64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def source_stft(
    s: torch.Tensor, lengths: torch.Tensor, num_frames: int, window: torch.Tensor, hop: int
) -> torch.Tensor:
    """s (b, l) with `lengths` [b] valid samples -> [real | imag] (b, 2j, num_frames), float32
    (float64 if s is).

    STFT frame q of row i is centred on sample hop*q of that row and reflect-padded at both of its
    ends, as torch.stft(center=True) would do for the row alone. Frames that would read past a
    row's reflect padding are garbage; callers only use frames < lengths // hop + 1.
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
    frames = padded.unfold(1, n_fft, hop) * window.to(s.device, dtype)  # (b, u, w)
    spec = torch.fft.rfft(frames, dim=-1)  # (b, u, j)
    out = torch.cat([spec.real, spec.imag], dim=-1)  # (b, u, 2j)
    return out.transpose(1, 2).contiguous()  # (b, 2j, u)


def istft_head(
    x: torch.Tensor, frames: torch.Tensor, window: torch.Tensor, hop: int, magnitude_limit: float
) -> torch.Tensor:
    """conv_post output x (b, 2j, u) -> audio (b, hop*(u-1)) float32 (float64 if x is); row i is
    valid for hop*(frames[i]-1) samples. Magnitude exp(x[:j]) clipped at `magnitude_limit`, phase
    sin(x[j:]) (upstream's redundant sin kept), inverse FFT, Hann, overlap-add, envelope."""
    x = x.to(_work_dtype(x))
    b, _, u = x.shape
    n_fft = window.shape[0]
    j = n_fft // 2 + 1
    magnitude = torch.clip(torch.exp(x[:, :j]), max=magnitude_limit)
    phase = torch.sin(x[:, j:])
    spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))  # (b, j, u)
    window = window.to(x.device, x.dtype)
    valid = torch.arange(u, device=x.device)[None, :] < frames.to(x.device)[:, None]  # (b, u)
    seg = torch.fft.irfft(spec, n=n_fft, dim=1) * window[None, :, None]  # (b, w, u)
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
