"""Warm-up shapes: the requests the engine runs before SERVING (and benchmarks replay)."""

from __future__ import annotations

import numpy as np
import torch

from flow_service.model import FlowRequest, Voice
from token2wav import VOCAB_SIZE


def warmup_batch(batch: int, num_frames: int) -> list[FlowRequest]:
    """`batch` requests whose DiT sequence is `num_frames` long (>= 4), streaming and final
    rows alternating, from a fixed random voice."""
    rng = np.random.default_rng(0)
    n_p = min(25, num_frames // 4)
    voice = Voice(
        torch.from_numpy(rng.integers(0, VOCAB_SIZE, n_p)),
        torch.from_numpy(rng.standard_normal((2 * n_p, 80)).astype(np.float32)),
        torch.from_numpy(rng.standard_normal(192).astype(np.float32)),
    )
    n_emit = num_frames // 2 - n_p
    reqs = []
    for i in range(batch):
        final = i % 2 == 1
        tokens = torch.from_numpy(rng.integers(0, VOCAB_SIZE, n_emit + (0 if final else 3)))
        reqs.append(FlowRequest(voice, tokens, 0, finalize=final, streaming=not final))
    return reqs


def warmup_requests() -> list[FlowRequest]:
    """A first chunk and a final chunk of a 3 s prompt: what the service will see first."""
    return warmup_batch(2, 200)
