"""Stage-2 vocoder configuration: constants, `HiFTConfig`, presets, receptive field (docs/REFERENCE.md §1.2, §5).

The shared audio constants (`SAMPLE_RATE`, `SAMPLES_PER_FRAME`, `MEL_BINS`, `MAX_FRAMES`) are
stated once, in `token2wav`, and imported from there. `context_frames()` derives the incremental
session's window from the layer geometry, so a config with other kernels gets a window that
still covers them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from token2wav import MAX_FRAMES, MEL_BINS, SAMPLES_PER_FRAME

MAX_SAMPLES = MAX_FRAMES * SAMPLES_PER_FRAME  # 300 s: the length of the fixed noise buffers
F0_LOOK_RIGHT = 3  # f0 conv0 has kernel 4 and reads 3 frames to the right (docs/REFERENCE.md §5.3)
CONV_PRE_LOOK_RIGHT = 4  # conv_pre: kernel 5, reads 4 frames to the right (docs/REFERENCE.md §5.2)
# Without finalize the last 3 + 4 + 1 frames are held back: f0 context, conv_pre context, and
# one frame of iSTFT overlap-add / source-STFT look-right (docs/REFERENCE.md §5.5-5.6).
HOLDBACK_FRAMES = F0_LOOK_RIGHT + CONV_PRE_LOOK_RIGHT + 1
NOISE_SEED = 0  # seed of the fixed source-noise buffers (see noise.py)


@dataclass(frozen=True)
class HiFTConfig:
    """`CausalHiFTGenerator` with `CausalConvRNNF0Predictor` (docs/REFERENCE.md §1.2, §5.2-5.4)."""

    in_channels: int = MEL_BINS
    base_channels: int = 512  # conv_pre width; stage i has base / 2^(i+1) channels
    nb_harmonics: int = 8  # overtones above f0: 9 sine components
    nsf_alpha: float = 0.1  # sine amplitude
    nsf_sigma: float = 0.003  # noise amplitude where voiced (unvoiced: nsf_alpha / 3)
    nsf_voiced_threshold: float = 10.0  # Hz; f0 above it counts as voiced
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    post_lrelu_slope: float = 0.01  # upstream calls F.leaky_relu with its default before conv_post
    audio_limit: float = 0.99  # output clamp
    magnitude_limit: float = 100.0  # iSTFT magnitude = min(exp(x), 100)
    conv_pre_look_right: int = CONV_PRE_LOOK_RIGHT
    f0_cond_channels: int = 512
    f0_num_convs: int = 5  # conv0 (kernel 4, right context) + 4 left-causal kernel-3 convs
    noise_seed: int = NOISE_SEED
    # "exact": float64 phase in cycles mod 1; "upstream": upstream's float32 phase as its CPU
    # cumsum rounds it (layers.SourceModule). Both are exact across chunks.
    phase_mode: str = "exact"
    # Extra frames of mel history the session recomputes beyond the exact receptive field.
    context_margin_frames: int = 8

    def __post_init__(self):
        n = len(self.upsample_rates)
        lists = (
            self.upsample_kernel_sizes,
            self.source_resblock_kernel_sizes,
            self.source_resblock_dilations,
        )
        if any(len(x) != n for x in lists):
            raise ValueError(f"upsample/source-resblock lists must all have {n} entries")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilations):
            raise ValueError("resblock_kernel_sizes and resblock_dilations differ in length")
        if math.prod(self.upsample_rates) * self.istft_hop != SAMPLES_PER_FRAME:
            raise ValueError(
                f"prod(upsample_rates) x istft_hop must be {SAMPLES_PER_FRAME} samples per mel frame"
            )
        if self.istft_n_fft != 4 * self.istft_hop:
            raise ValueError("the iSTFT head assumes n_fft = 4 x hop (75% overlap)")
        if self.conv_pre_look_right != CONV_PRE_LOOK_RIGHT:
            raise ValueError(f"conv_pre_look_right must be {CONV_PRE_LOOK_RIGHT} (holdback 8)")
        if self.phase_mode not in ("exact", "upstream"):
            raise ValueError(f"phase_mode {self.phase_mode!r}: expected 'exact' or 'upstream'")
        if self.base_channels % 2**n:
            raise ValueError(f"base_channels must be divisible by 2^{n}")

    @property
    def num_harmonics(self) -> int:
        """Sine components including the fundamental (9)."""
        return self.nb_harmonics + 1

    @property
    def stft_bins(self) -> int:
        return self.istft_n_fft // 2 + 1

    @property
    def stft_frames_per_frame(self) -> int:
        """Source-STFT frames (= last-stage positions) per mel frame: 120."""
        return SAMPLES_PER_FRAME // self.istft_hop

    def stage_channels(self, i: int) -> int:
        return self.base_channels // 2 ** (i + 1)

    def source_down_rates(self) -> list[int]:
        """Stride of source_downs[i]: STFT frames per stage-i position (15, 3, 1)."""
        rates = list(self.upsample_rates)
        return [math.prod(rates[i + 1 :]) for i in range(len(rates))]

    @property
    def f0_context_frames(self) -> int:
        """Mel frames left of a new f0 frame that it depends on: 2 per kernel-3 conv (8)."""
        return 2 * (self.f0_num_convs - 1)

    def context_frames(self) -> int:
        """Decoder window a session recomputes left of the first new output frame."""
        return receptive_field_frames(self) + self.context_margin_frames


HIFT_PRESETS: dict[str, HiFTConfig] = {
    # Fun-CosyVoice3-0.5B-2512 hift.pt: 20,779,887 parameters (weight-norm g included).
    "cosyvoice3-0.5b": HiFTConfig(),
    # Same kernels, rates and lengths (480 samples per frame, same receptive field), 1/8 width.
    "small": HiFTConfig(base_channels=64, f0_cond_channels=64),
}


def _resblock_left(kernel_sizes: tuple[int, ...], dilations) -> int:
    """Left context of the widest ResBlock: each dilation d runs a (k, d) then a (k, 1) conv."""
    return max(sum((k - 1) * d + (k - 1) for d in dils) for k, dils in zip(kernel_sizes, dilations))


@functools.lru_cache(maxsize=64)  # a pure function of a frozen config; every chunk asks
def receptive_field_frames(cfg: HiFTConfig) -> int:
    """Smallest R such that, with f0 and the source frozen, every output sample of mel frame
    >= w0 + R is independent of anything before frame w0 of a decode window.

    Traces the earliest input each layer reads, from the first sample of output frame K back
    to conv_pre's input (mel frames), and to the source STFT (frames >= 2 avoid the reflect pad
    at the window edge); position 0 of the last stage is the ReflectionPad1d copy. The trace is
    exact for the layer geometry; tests/test_vocoder_model.py measures the same number by
    perturbing inputs.
    """
    n_stages = len(cfg.upsample_rates)
    down = cfg.source_down_rates()
    rb = [
        _resblock_left(cfg.resblock_kernel_sizes, cfg.resblock_dilations) for _ in range(n_stages)
    ]
    srb = [
        _resblock_left((k,), (d,))
        for k, d in zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilations)
    ]

    def ok(k: int) -> bool:
        n = SAMPLES_PER_FRAME * k  # first output sample of frame k (window starts at frame 0)
        p = math.ceil((n + cfg.istft_n_fft // 2 - (cfg.istft_n_fft - 1)) / cfg.istft_hop)
        p -= 6  # conv_post, kernel 7
        for i in reversed(range(n_stages)):
            p -= rb[i]  # the widest of the stage's ResBlocks
            if p < 0 or (i == n_stages - 1 and p < 1):  # padded position 0 is a copy
                return False
            src = p - srb[i]  # source ResBlock, then source_downs[i]
            stft_first = down[i] * src - (down[i] - 1) if down[i] > 1 else src
            if src < 0 or stft_first < 2:
                return False
            if i == n_stages - 1:
                p -= 1  # undo ReflectionPad1d((1, 0))
            p = math.floor((p - (cfg.upsample_kernel_sizes[i] - 1)) / cfg.upsample_rates[i])
        return p >= 0  # p is now a mel frame read by conv_pre (which reads none to its left)

    k = 0
    while not ok(k):
        k += 1
    return k
