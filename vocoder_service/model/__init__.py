"""Causal HiFT vocoder model (docs/REFERENCE.md §5): full-history decode, bounded incremental sessions batched
across streams, versioned session export, strict hift.pt loading. No grpc, no session ids."""

from token2wav import MAX_FRAMES, MEL_BINS, SAMPLE_RATE
from token2wav.invalid import InvalidInput
from vocoder_service.model.config import (
    HIFT_PRESETS,
    HOLDBACK_FRAMES,
    MAX_SAMPLES,
    NOISE_SEED,
    HiFTConfig,
    receptive_field_frames,
)
from vocoder_service.model.errors import CheckpointError
from vocoder_service.model.generator import HiFTGenerator
from vocoder_service.model.loading import infer_config, init_random_weights, load_hift
from vocoder_service.model.noise import hift_noise_buffers
from vocoder_service.model.session import STATE_VERSION, HiFTSessionState

__all__ = [
    "HIFT_PRESETS",
    "HOLDBACK_FRAMES",
    "MAX_FRAMES",
    "MAX_SAMPLES",
    "MEL_BINS",
    "NOISE_SEED",
    "SAMPLE_RATE",
    "STATE_VERSION",
    "CheckpointError",
    "HiFTConfig",
    "HiFTGenerator",
    "HiFTSessionState",
    "InvalidInput",
    "hift_noise_buffers",
    "infer_config",
    "init_random_weights",
    "load_hift",
    "receptive_field_frames",
]
