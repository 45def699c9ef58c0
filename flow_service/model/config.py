"""Stage-1 flow configuration: constants, per-component frozen configs and presets (docs/REFERENCE.md §1.1).

The shared audio constants come from `token2wav` (stated once there); the ones below belong to
the flow model alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from token2wav import (
    MAX_FRAMES,
    MEL_BINS,
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    SPK_EMBED_DIM,
    TOKEN_MEL_RATIO,
    VOCAB_SIZE,
)

MEL_FRAME_RATE = SAMPLE_RATE // SAMPLES_PER_FRAME  # 50 Hz

PRE_LOOKAHEAD = 3  # tokens of right context the pre-lookahead conv reads (120 ms)
BLOCK_FRAMES = 50  # streaming attention block, mel frames (25 tokens = 1 s); aligned to frame 0
NUM_STEPS = 10  # Euler steps, hard-coded upstream in CausalMaskedDiffWithDiT.inference
CFG_RATE = 0.7  # classifier-free guidance strength: v = (1 + r) v_cond - r v_uncond
NOISE_SEED = 0  # rand_noise = randn(1, 80, MAX_FRAMES) right after manual_seed(0)

__all__ = [
    "BLOCK_FRAMES",
    "CFG_RATE",
    "FLOW_PRESETS",
    "MAX_FRAMES",
    "MEL_BINS",
    "MEL_FRAME_RATE",
    "NOISE_SEED",
    "NUM_STEPS",
    "PRE_LOOKAHEAD",
    "SPK_EMBED_DIM",
    "TOKEN_MEL_RATIO",
    "VOCAB_SIZE",
    "DiTConfig",
    "FlowConfig",
]


@dataclass(frozen=True)
class DiTConfig:
    """The velocity estimator `decoder.estimator` (docs/REFERENCE.md §4)."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64  # rotary covers the first dim_head channels of q/k, i.e. head 0 only
    ff_mult: int = 2
    mel_dim: int = MEL_BINS  # x, cond and output channels
    mu_dim: int = MEL_BINS  # token features after the pre-lookahead layer
    spk_dim: int = MEL_BINS  # speaker vector after spk_embed_affine_layer
    time_freq_dim: int = 256  # sinusoidal time features before the time MLP
    conv_pos_kernel: int = 31
    conv_pos_groups: int = 16
    block_frames: int = BLOCK_FRAMES
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.heads * self.dim_head != self.dim:
            raise ValueError(f"heads x dim_head = {self.heads * self.dim_head} != dim {self.dim}")
        if self.dim % self.conv_pos_groups:
            raise ValueError(f"dim {self.dim} not divisible by {self.conv_pos_groups} groups")
        if self.dim_head % 2:
            raise ValueError("dim_head must be even for rotary pairs")


@dataclass(frozen=True)
class FlowConfig:
    """The flow wrapper `CausalMaskedDiffWithDiT` and its solver (docs/REFERENCE.md §2, §3)."""

    vocab_size: int = VOCAB_SIZE
    mel_dim: int = MEL_BINS  # token embedding width equals the mel width (no encoder)
    spk_embed_dim: int = SPK_EMBED_DIM  # CAM++ x-vector
    pre_lookahead_len: int = PRE_LOOKAHEAD
    pre_lookahead_channels: int = 1024
    token_mel_ratio: int = TOKEN_MEL_RATIO
    num_steps: int = NUM_STEPS
    cfg_rate: float = CFG_RATE
    max_frames: int = MAX_FRAMES  # noise buffer length: the 300 s cap on prompt + target
    dit: DiTConfig = field(default_factory=DiTConfig)

    def __post_init__(self):
        if self.dit.mel_dim != self.mel_dim or self.dit.mu_dim != self.mel_dim:
            raise ValueError("DiT mel/mu widths must equal the flow mel width")


FLOW_PRESETS: dict[str, FlowConfig] = {
    # Fun-CosyVoice3-0.5B: 332,257,088 parameters in flow.pt (331.1 M of them in the DiT).
    "cosyvoice3-0.5b": FlowConfig(),
    # Tests and the CPU demo: every interface constant of the real model, tiny widths. Two heads
    # of 64 keep "rotary on head 0 only" meaningful.
    "small": FlowConfig(
        pre_lookahead_channels=128,
        dit=DiTConfig(dim=128, depth=3, heads=2, dim_head=64, ff_mult=2),
    ),
}
