"""HiFT building blocks: causal convs, Snake, ResBlock, the f0 predictor, the NSF source (docs/REFERENCE.md §5).

Attribute names mirror hift.pt (`convs1.0`, `activations1.0.alpha`, `condnet.2`, `l_linear`, ...)
and weight-normalised convs carry `parametrizations.weight.original0/1`, so the checkpoint loads
as is. Causal padding uses the conv's own symmetric zero padding and drops the surplus outputs
on the right: the same zeros on the left as upstream's explicit pad, one kernel fewer.

Dimensions (docs/DESIGN.md "Shape letters"):
    b  rows (sessions in a batch, or 1)
    c  channels
    t  mel frames
    u  positions at an upsampled rate (8t, 40t, 120t + 1 = STFT frames)
    t_f0  mel frames with f0 / phase values
    l  source samples (480 per mel frame)
    m  sine components (9: fundamental + 8 overtones)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from token2wav import SAMPLE_RATE, SAMPLES_PER_FRAME
from vocoder_service.model.config import F0_LOOK_RIGHT, HiFTConfig
from vocoder_service.model.noise import hift_noise_buffers

SNAKE_EPS = 1e-9  # upstream's no_div_by_zero in Snake


def causal_conv(cin: int, cout: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    """A left-causal conv: symmetric padding (k-1)d; `run_causal` drops the right surplus."""
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding=(kernel - 1) * dilation)


def run_causal(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    return conv(x)[..., : x.shape[-1]]


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, one linear-scale alpha per channel.

    `fused` (HiFTGenerator.fuse_snake): the same formula in 4 kernels instead of 7, one pass
    less over x: 1 / (alpha + eps) computed once per weight version and dtype (the same
    values), the product and the sum in one addcmul (equal up to a fused multiply-add's
    rounding)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))
        self.fused = False
        self._inverse: tuple[tuple, torch.Tensor] | None = None  # (alpha's identity, 1/alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha[None, :, None]  # (1, c, 1)
        if self.fused:
            return torch.addcmul(x, torch.sin(x * alpha).pow_(2), self.inverse_alpha(alpha))
        return x + (1.0 / (alpha + SNAKE_EPS)) * torch.sin(x * alpha).pow(2)

    def inverse_alpha(self, alpha: torch.Tensor) -> torch.Tensor:
        try:
            version = alpha._version
        except RuntimeError:  # an inference tensor (weights made in inference mode) has none
            version = -1
        key = (alpha.data_ptr(), version, alpha.dtype, alpha.device)
        if self._inverse is None or self._inverse[0] != key:
            self._inverse = (key, 1.0 / (alpha + SNAKE_EPS))
        return self._inverse[1]


class ResBlock(nn.Module):
    """Causal residual block: per dilation d, Snake -> conv(k, d) -> Snake -> conv(k, 1), added."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(causal_conv(channels, channels, kernel, d)) for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(causal_conv(channels, channels, kernel)) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = run_causal(c2, a2(run_causal(c1, a1(x)))) + x
        return x


class CausalUpsample(nn.Conv1d):
    """Nearest-neighbour upsampling by `rate`, then a left-causal conv (docs/REFERENCE.md §5.1)."""

    def __init__(self, cin: int, cout: int, kernel: int, rate: int):
        super().__init__(cin, cout, kernel, padding=kernel - 1)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape  # nearest-neighbour repeat as a view + one copy (no repeats tensor)
        x = x[..., None].expand(b, c, t, self.rate).reshape(b, c, t * self.rate)
        return super().forward(x)[..., : x.shape[-1]]


class SourceDown(nn.Conv1d):
    """Source-STFT downsampling: left pad rate-1, kernel 2 rate, stride rate; rate 1 is a 1x1."""

    def __init__(self, cin: int, cout: int, rate: int):
        if rate == 1:
            super().__init__(cin, cout, 1)
        else:
            # Symmetric padding rate-1: outputs below num_out read exactly upstream's windows (its pad is
            # left only); the extra right zeros only create outputs that are sliced off.
            super().__init__(cin, cout, 2 * rate, stride=rate, padding=rate - 1)

    def forward(self, x: torch.Tensor, num_out: int) -> torch.Tensor:
        return super().forward(x)[..., :num_out]


class CausalF0Predictor(nn.Module):
    """`CausalConvRNNF0Predictor`: conv0 (k=4) reads 3 frames to the right, four left-causal
    k=3 convs, ELU after each, Linear(c -> 1), |.| -> f0 in Hz (docs/REFERENCE.md §5.3). Runs in float64."""

    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        c = cfg.f0_cond_channels
        conv0 = nn.Conv1d(cfg.in_channels, c, F0_LOOK_RIGHT + 1)  # reads 3 frames to the right
        layers: list[nn.Module] = [weight_norm(conv0), nn.ELU()]
        for _ in range(cfg.f0_num_convs - 1):
            layers += [weight_norm(causal_conv(c, c, 3)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(c, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel (b, 80, t_f0 + 3) incl. the right context -> f0 (b, t_f0) in Hz."""
        return self.raw_output(mel).abs()

    def raw_output(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.condnet[1](self.condnet[0](mel))
        for i in range(2, len(self.condnet), 2):
            x = self.condnet[i + 1](run_causal(self.condnet[i], x))
        return self.classifier(x.transpose(1, 2)).squeeze(-1)  # (b, t_f0, c) -> (b, t_f0)


class SourceModule(nn.Module):
    """`SourceModuleHnNSF` with the causal SineGen2, reduced to what the generator uses: the
    harmonic excitation tanh(Linear(9 -> 1)(sines x uv + noise)) (docs/REFERENCE.md §5.4).

    Upstream's phase is a per-frame staircase: r = (i f0 / 24000) mod 1 per frame for harmonic
    i (float32), S_k = cumsum(r) in float32, sine = sin(S_k x 2 pi x 480) held for the frame's
    480 samples.
    Only the phase modulo one cycle matters, but float32 S_k has an ulp of 1.2e-4 cycles at
    S = 1500 (60 s), which x480 becomes 0.06 cycles: upstream's long-utterance phase is mostly
    rounding. Two modes (HiFTConfig.phase_mode), both exact across chunks:

    "exact" (default): the state per frame is P_k = frac(sum_j<=k frac(480 r_j)) in float64 cycles
        and sine = sin(2 pi P_k): the real-number value of upstream's formula.
    "upstream": the state per frame is S_k, accumulated in float64 like torch's CPU cumsum of a
        float32 tensor (its accumulator is double), then rounded to float32 and scaled as
        upstream does; this matches upstream run on CPU bit for bit in the phase, long
        utterances included. (Upstream on CUDA sums in float32 in a parallel scan: neither mode,
        nor upstream's own CPU run, reproduces that rounding.)

    Measured effect of "exact" against upstream run as is (torch CPU, fp32, random weights with
    upstream's code loaded strictly from the same state dict, noise buffers copied in): max abs
    3.3e-5 / 9.3e-5 at 3 s / 10 s (full preset; SNR 77 / 68 dB) and 5.7e-4 at 60 s (small
    preset; SNR 56 dB). With upstream's cumsum done in float64 instead, or with "upstream" mode
    here, the difference is 1.4e-7 to 1.8e-7 at every length, sessions included.
    """

    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        self.cfg = cfg
        self.l_linear = nn.Linear(cfg.num_harmonics, 1)

    @property
    def sine_noise(self) -> torch.Tensor:
        """The fixed (MAX_SAMPLES, 9) U[0, 1) noise buffer (CPU, shared; see noise.py)."""
        return hift_noise_buffers(self.cfg.noise_seed)["sine_noise"]

    def advance_phase(self, f0: torch.Tensor, carry: torch.Tensor):
        """f0 [t_f0] of new frames (float32, or float64 in checks), carry [m] float64 (the last
        frame's phase state, 0 at the start) -> (phase state (t_f0, m) float64, new carry [m])."""
        harmonics = torch.arange(1, self.cfg.num_harmonics + 1, dtype=f0.dtype, device=f0.device)
        rad = (f0[:, None] * harmonics) / SAMPLE_RATE % 1  # upstream's rad_values, (t_f0, m)
        if self.cfg.phase_mode == "upstream":
            # Sequential float64 sum seeded with the carry: what CPU cumsum does from frame 0.
            seq = torch.cat([carry[None].to(rad.device), rad.double()])  # (1 + t_f0, m)
            phase = torch.cumsum(seq, dim=0)[1:]
        else:
            inc = (rad.double() * SAMPLES_PER_FRAME) % 1  # cycles per frame after the x480
            phase = (carry.to(rad.device) + torch.cumsum(inc, dim=0)) % 1
        return phase, phase[-1] if phase.shape[0] else carry

    def sines(self, phase: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Per-frame phase state (b, t_f0, m) float64 -> sin(phase angle) (b, t_f0, m) in `dtype`."""
        if self.cfg.phase_mode == "upstream":
            angle = (phase.float() * 2 * math.pi) * SAMPLES_PER_FRAME  # float32 ops as upstream
            return torch.sin(angle).to(dtype)
        return torch.sin(phase * (2 * math.pi)).to(dtype)

    def excitation(self, f0: torch.Tensor, phase: torch.Tensor, noise: torch.Tensor):
        """f0 (b, t_f0), phase state (b, t_f0, m) float64, noise (b, l, m) U[0, 1), l = 480 t_f0
        -> source (b, l), all in f0's dtype (float32 like upstream's mel dtype, float64 in checks)."""
        cfg = self.cfg
        b, t_f0 = f0.shape
        dtype = f0.dtype
        spf, samples = SAMPLES_PER_FRAME, t_f0 * SAMPLES_PER_FRAME
        sine = self.sines(phase, dtype) * cfg.nsf_alpha  # (b, t_f0, m)
        uv = (f0 > cfg.nsf_voiced_threshold).to(dtype)[..., None]  # (b, t_f0, 1)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3  # (b, t_f0, 1)
        per_sample = (b, t_f0, spf, cfg.num_harmonics)
        sine_uv = (sine * uv)[:, :, None].expand(per_sample).reshape(b, samples, -1)  # (b, l, m)
        amp = noise_amp[:, :, None].expand(b, t_f0, spf, 1).reshape(b, samples, 1)
        waves = sine_uv + amp * noise.to(dtype)  # (b, l, m)
        w, bias = self.l_linear.weight.to(dtype), self.l_linear.bias.to(dtype)
        return torch.tanh(F.linear(waves, w, bias)).squeeze(-1)  # (b, l, 1) -> (b, l)
