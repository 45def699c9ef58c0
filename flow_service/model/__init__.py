"""Stage-1 flow model: CosyVoice3 DiT flow matching, weight-compatible with the official
`flow.pt`, batched over ragged streams. No grpc here; state lives in the caller's objects."""

from flow_service.model.batching import group_by_length
from flow_service.model.config import (
    BLOCK_FRAMES,
    CFG_RATE,
    FLOW_PRESETS,
    MAX_FRAMES,
    MEL_BINS,
    NUM_STEPS,
    PRE_LOOKAHEAD,
    SPK_EMBED_DIM,
    TOKEN_MEL_RATIO,
    VOCAB_SIZE,
    DiTConfig,
    FlowConfig,
)
from flow_service.model.dit import FUSED_KERNELS, DiT, DiTKernels, attention_bias
from flow_service.model.flow import BatchIntegrityError, FlowBatch, FlowModel
from flow_service.model.graphs import GraphedEstimator
from flow_service.model.loading import (
    CheckpointError,
    config_from_state_dict,
    init_random_,
    load_flow,
    read_state_dict,
)
from flow_service.model.prefix_cache import PrefixCache
from flow_service.model.requests import (
    FlowRequest,
    InvalidInput,
    Voice,
    validate_request,
    validate_voice,
)
from flow_service.model.solver import cosine_schedule, noise_buffer

__all__ = [
    "BLOCK_FRAMES",
    "CFG_RATE",
    "FLOW_PRESETS",
    "MAX_FRAMES",
    "MEL_BINS",
    "NUM_STEPS",
    "PRE_LOOKAHEAD",
    "SPK_EMBED_DIM",
    "TOKEN_MEL_RATIO",
    "VOCAB_SIZE",
    "BatchIntegrityError",
    "CheckpointError",
    "FlowRequest",
    "DiT",
    "DiTConfig",
    "DiTKernels",
    "FUSED_KERNELS",
    "FlowBatch",
    "FlowConfig",
    "FlowModel",
    "GraphedEstimator",
    "InvalidInput",
    "PrefixCache",
    "Voice",
    "attention_bias",
    "config_from_state_dict",
    "cosine_schedule",
    "group_by_length",
    "init_random_",
    "load_flow",
    "noise_buffer",
    "read_state_dict",
    "validate_request",
    "validate_voice",
]
